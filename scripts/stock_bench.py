"""One engine server, synced two ways: weightsync's own path and the stock path (its own reload).

  .venv/bin/python scripts/stock_bench.py --engine vllm --size base --repeats 3
  .venv/bin/python scripts/stock_bench.py --engine sglang --size base --repeats 3

The server, CPU, bfloat16 OPT of `--size`, started with weightsync's receiving code so that both
paths can drive the same server:
- vLLM: `python -m vllm.entrypoints.openai.api_server` (eager) with weightsync's extension and
  guard and VLLM_SERVER_DEV_MODE=1; weightsync: `VllmEngineActor(url=...)`; stock:
  `VllmStockEngine(url=...)` (buckets staged into a safetensors file in /dev/shm, then /pause,
  /collective_rpc reload_weights, /reset_prefix_cache, /update_weight_version, /resume);
- SGLang: `python -m sglang.launch_server` with weightsync's loader and its CPU flags;
  weightsync: `SglEngineActor(url=...)`; stock: `SglStockEngine(url=...)` (staged the same way,
  then /update_weights_from_disk).
weightsync's path writes the trainer's tensors into the engine's parameters (buckets the first
time, then the one-copy path over shared memory); neither path is verified here.
The trainer: one FSDP2 rank in the engine's env (gloo), shared-memory transport, 256 MiB buckets.
Measured: `SyncReport.sync_s` of each path (the trainer's wall time of `sync()`: every engine
call, the stock reload included; vLLM's re-packing of its CPU GEMM weights after a reload is in
the stock path's time, after weightsync's path in the background, `settle`, not included),
best of `--repeats` after one warm-up sync each, alternating. Prints a table and one JSON line.
Run it in the project's root env (it builds the engine's env if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    parser.add_argument("--size", default="base", help="OPT size: tiny, small, base, medium")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from weightsync.apps.models import make_tiny_model
    from weightsync.driver import envs, launcher
    from weightsync.engine.server import LocalServer, cli_flags

    work = tempfile.mkdtemp(prefix="stock-bench-", dir="/dev/shm")
    model = make_tiny_model(
        os.path.join(work, "model"), arch="opt", size=args.size, dtype="bfloat16"
    )
    key = secrets.token_urlsafe(16)
    env_name = "vllm-cpu" if args.engine == "vllm" else "sglang"
    envs.build(env_name, groups=("trainer",), quiet=True)
    py = str(envs.python_path(env_name))
    if args.engine == "vllm":
        from weightsync.backends.vllm.engine import attach_flags

        command = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        command += ["--dtype", "bfloat16", "--enforce-eager", *attach_flags()]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1"}
        server = LocalServer(command, name="vllm", api_key=key, env=env)
        ours_class = "weightsync.backends.vllm.engine.VllmEngineActor"
        stock_class = "weightsync.backends.vllm.stock.VllmStockEngine"
        worker = "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker"
    else:
        from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS
        from weightsync.backends.sglang.engine import attach_flags as sgl_flags

        command = [py, "-m", "sglang.launch_server", "--model-path", model, "--dtype", "bfloat16"]
        command += [*cli_flags(CPU_ENGINE_ARGS), *sgl_flags(), f"--api-key={key}"]
        server = LocalServer(command, name="sglang", api_key=key)
        ours_class = "weightsync.backends.sglang.engine.SglEngineActor"
        stock_class = "weightsync.backends.sglang.stock.SglStockEngine"
        worker = "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker"
    launcher.init_ray(num_cpus=2)
    try:
        ours = launcher.launch(ours_class, url=server.base, api_key=key)
        stock = launcher.launch(stock_class, url=server.base, api_key=key)
        trainer = launcher.TrainerGroup(
            worker,
            model_path=model,
            world_size=1,
            dtype="bfloat16",
            bucket_bytes=256 << 20,
            verify=False,  # a stock engine cannot be verified
        )
        trainer.call("connect", {"weightsync": ours, "stock": stock})
        times: dict[str, list[float]] = {"weightsync": [], "stock": []}
        paths: dict[str, str] = {}
        nbytes = 0
        for i in range(args.repeats + 1):
            for name in times:
                ray.get(ours.settle.remote(), timeout=600)  # vLLM's background re-pack
                report = trainer.sync(f"{name}-{i}", engines=[name])
                nbytes = report.nbytes
                if i:  # the first of each is the warm-up
                    times[name].append(report.sync_s)
                    paths[name] = report.engines[name].path
        result = {
            "engine": args.engine,
            "size": args.size,
            "nbytes": nbytes,
            "repeats": args.repeats,
            "sync_s": {n: min(t) for n, t in times.items()},
            "path": paths,
        }
        result["stock_over_weightsync"] = result["sync_s"]["stock"] / result["sync_s"]["weightsync"]
        print(
            f"{args.engine}, OPT {args.size}, {nbytes / 1e6:.1f} MB bfloat16, "
            f"best of {args.repeats}:"
        )
        for name, seconds in result["sync_s"].items():
            print(
                f"  {name:10s} {paths[name]:9s} {seconds:8.3f} s  {nbytes / seconds / 1e9:6.3f} GB/s"
            )
        print(json.dumps(result))
        trainer.kill()
        for actor in (ours, stock):
            ray.get(actor.shutdown.remote(), timeout=120)
    finally:
        ray.shutdown()
        server.shutdown()
        subprocess.run(["rm", "-rf", work], check=False)


if __name__ == "__main__":
    sys.exit(main())
