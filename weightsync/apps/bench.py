"""`weightsync bench`: our sync beside the engines' native paths and a memcpy, in one run.

For each OPT size: a 2-rank FSDP2 trainer (bf16, gloo) in the sglang env, one SGLang and one vLLM
engine (bf16, in-process). Measured, best of `--repeats` after one warm-up:
- memcpy: one torch copy_ of the same bytes in the trainer process (the floor);
- transport: pack every (already gathered) tensor into shared-memory buckets and copy it out
  into preallocated tensors through a receiver's mapping: two copies, no gather, no engine;
- weightsync: sync into one engine, and apart from it the cost of verifying. After warm-up this
  is the one-copy path (weightsync/trainer/one_copy/targets.py: the ranks write into the engine's shared
  parameters); the first sync, by buckets, is the warm-up;
- native, each stage timed on its own and summed (the best case for the native path, as nothing
  moves between the stages): SGLang gather + update_weights_from_tensor (tensors already in the
  engine's process), gather + save safetensors + update_weights_from_disk; vLLM gather + save +
  reload_weights.
With `--tp N` / `--replicas M`: M vLLM engines of N workers each in one sync (`_bench_topology`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from weightsync.wire.protocol import SettleReport

log = logging.getLogger("weightsync.apps.bench")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="sync speed beside native engine paths and memcpy")
    p.add_argument("--sizes", default="medium", help="comma-separated: tiny,small,base,medium")
    p.add_argument("--engines", default="sglang,vllm", help="comma-separated: sglang, vllm")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best kept)")
    p.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="GB/s against model size")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="with --tp > 1 or --replicas > 1: vLLM engines of this "
        "tensor_parallel_size (a topology run, vLLM only)",
    )
    p.add_argument("--replicas", type=int, default=1, help="engine replicas in a topology run")
    p.set_defaults(run=run)


def _bench_model(size: str) -> tuple[str, str]:
    """(a scratch folder in /dev/shm, the bf16 OPT checkpoint of `size` saved inside it)."""
    from weightsync.apps.models import make_tiny_model

    work = tempfile.mkdtemp(prefix=f"wsbench-{size}-", dir="/dev/shm")
    return work, make_tiny_model(
        os.path.join(work, "model"), arch="opt", size=size, seed=0, dtype="bfloat16"
    )


def _bench_trainer(model: str, args: argparse.Namespace) -> Any:
    """The bench's 2-rank trainer (`BenchWorker`, in the sglang env) over `model`."""
    from weightsync.driver import launcher

    launcher.register_actor("weightsync.apps.bench_worker.BenchWorker", "sglang")
    return launcher.TrainerGroup(
        "weightsync.apps.bench_worker.BenchWorker",
        env="sglang",
        model_path=model,
        dtype="bfloat16",
        bucket_bytes=args.bucket_mb << 20,
        timeout_s=300,
    )


def _tear_down(engines: dict[str, Any], trainer: Any, work: str) -> None:
    import ray

    for engine in engines.values():
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine.handle)
    trainer.call("shutdown")
    trainer.kill()
    shutil.rmtree(work, ignore_errors=True)


def _bench_topology(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """`--replicas` vLLM engines of `--tp` workers each, one sync into all of them: the sync
    time, the bytes the trainer's ranks wrote into every worker's parameters (one-copy path)
    and a memcpy of that many bytes, measured in the trainer's process in the same run."""
    import ray

    from weightsync.apps.models import model_bytes
    from weightsync.driver import launcher

    work, model = _bench_model(size)
    engines = {
        f"vllm-{i}": launcher.launch(
            "weightsync.backends.vllm.engine.VllmEngineActor",
            model,
            dtype="bfloat16",
            tensor_parallel_size=args.tp,
        )
        for i in range(args.replicas)
    }
    trainer = _bench_trainer(model, args)
    trainer.call("connect", engines)
    trainer.call("sync", verify=False)  # by buckets; the engines then share their parameters
    trainer.call("sync", verify=False)  # the ranks map the shared parameters
    syncs = []
    for _ in range(max(1, args.repeats)):
        ray.get([e.settle.remote() for e in engines.values()])
        syncs.append(trainer.call("sync", verify=False))
    best = min(syncs, key=lambda r: r["sync_s"])
    checked = trainer.call("sync", verify=True)
    written = int(best.get("bytes_written", 0))
    result = {
        "size": size,
        "tp": args.tp,
        "replicas": args.replicas,
        "nbytes": model_bytes("opt", size, dtype="bfloat16"),
        "path": best["path"],
        "sync_s": best["sync_s"],
        "bytes_written": written,
        "phases_s": best.get("phases_s"),
        "memcpy_s": trainer.call("bench_memcpy", max(written, 1)),
        "verified": all(v["verified"] for k, v in checked["verify"].items() if k != "verify_s"),
    }
    _tear_down(engines, trainer, work)
    return result


def _run_topology(args: argparse.Namespace, sizes: list[str]) -> int:
    import ray

    from weightsync.driver import envs, launcher

    for env in ("sglang", envs.default_vllm_env()):
        envs.build(env)
    launcher.init_ray(num_cpus=2, log_to_driver=False)
    results = [_bench_topology(size, args) for size in sizes]
    ray.shutdown()
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one sync into {args.replicas} vLLM replica(s) of TP={args.tp}")
    for col in (
        "size",
        "model GB",
        "path",
        "bytes written GB",
        "sync ms",
        "written GB/s",
        "memcpy GB/s",
        "ratio",
        "verified",
        "begin / write / end ms",
    ):
        table.add_column(col)
    for r in results:
        rate = _gbps(r["bytes_written"], r["sync_s"])
        copy = _gbps(r["bytes_written"], r["memcpy_s"])
        table.add_row(
            r["size"],
            f"{r['nbytes'] / 1e9:.3f}",
            r["path"],
            f"{r['bytes_written'] / 1e9:.3f}",
            f"{r['sync_s'] * 1e3:.0f}",
            f"{rate:.2f}",
            f"{copy:.2f}",
            f"{rate / copy:.2f}" if copy else "-",
            str(r["verified"]),
            " / ".join(
                f"{(r['phases_s'] or {}).get(k, 0) * 1e3:.0f}" for k in ("begin", "write", "end")
            ),
        )
    Console(width=160).print(table)
    return 0


def _bench_size(size: str, engines: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from weightsync.apps.models import model_bytes
    from weightsync.driver import launcher

    work, model = _bench_model(size)
    nbytes = model_bytes("opt", size, dtype="bfloat16")
    actors = {
        "sglang": lambda: launcher.launch(
            "weightsync.backends.sglang.engine.SglEngineActor",
            model,
            dtype="bfloat16",
            engine_args={"mem_fraction_static": 0.3},
        ),
        "vllm": lambda: launcher.launch(
            "weightsync.backends.vllm.engine.VllmEngineActor", model, dtype="bfloat16"
        ),
    }
    handles = {name: actors[name]() for name in engines}
    trainer = _bench_trainer(model, args)
    trainer.call("connect", handles)
    r = max(1, args.repeats)
    result: dict[str, Any] = {"size": size, "nbytes": nbytes}
    result["memcpy_s"] = trainer.call("bench_memcpy", nbytes)
    result["gather_s"] = min(trainer.call("bench_gather") for _ in range(r))
    trainer.call("bench_transport")
    result["transport_s"] = min(trainer.call("bench_transport") for _ in range(r))
    save_dir = os.path.join(work, "saved")
    os.makedirs(save_dir, exist_ok=True)
    result["gather_save_s"] = min(trainer.call("bench_gather_save", save_dir) for _ in range(r))
    result["engines"] = {}
    for name, handle in handles.items():
        # Warm-up: the first sync goes by buckets (maps segments, learns the load map), then
        # the engine shares its parameters; the second maps them into the trainer's ranks.
        warm = trainer.call("sync", engines=[name], verify=False)
        trainer.call("sync", engines=[name], verify=False)
        syncs = []
        for _ in range(r):
            ray.get(handle.settle.remote())  # as after a training step: background work done
            syncs.append(trainer.call("sync", engines=[name], verify=False))
        background = SettleReport.from_dict(ray.get(handle.settle.remote())).background_s
        best = min(syncs, key=lambda s: s["sync_s"])
        plain = best["sync_s"]
        times = [best["engines"][name]["session_s"]]
        phases = {k: best["engines"][name].get(k) for k in ("load_s", "end_s", "session_s")}
        checked = []
        for _ in range(r):
            ray.get(handle.settle.remote())
            checked.append(trainer.call("sync", engines=[name], verify=True))
        verified = all(c["verify"][name]["verified"] for c in checked)
        with_verify = min(c["sync_s"] + c["verify"]["verify_s"] for c in checked)
        native: dict[str, float] = {}
        if name == "sglang":
            ray.get(handle.native_update_from_tensor.remote(save_dir))  # warm-up
            native["gather+update_weights_from_tensor"] = result["gather_s"] + min(
                ray.get(handle.native_update_from_tensor.remote(save_dir)) for _ in range(r)
            )
            ray.get(handle.native_update_from_disk.remote(save_dir))
            native["gather+save+update_weights_from_disk"] = result["gather_save_s"] + min(
                ray.get(handle.native_update_from_disk.remote(save_dir)) for _ in range(r)
            )
        else:
            ray.get(handle.native_reload.remote(save_dir))
            native["gather+save+reload_weights"] = result["gather_save_s"] + min(
                ray.get(handle.native_reload.remote(save_dir)) for _ in range(r)
            )
        result["engines"][name] = {
            "sync_s": plain,
            "engine_session_s": min(times),
            "verify_extra_s": max(0.0, with_verify - plain),
            "verified": verified,
            "engine_phases_s": phases,
            "background_s": background,
            "path": best["engines"][name]["path"],
            "phases_s": best.get("phases_s"),
            "share_s": warm["engines"][name].get("share_s"),
            "native_s": native,
        }
        log.info("%s %s: sync %.3f s, native %s", size, name, plain, native)
    _tear_down(handles, trainer, work)
    return result


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def run(args: argparse.Namespace) -> int:
    import ray

    from weightsync.driver import envs, launcher

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.tp < 1 or args.replicas < 1:
        raise SystemExit(f"--tp {args.tp} --replicas {args.replicas}: both must be >= 1")
    if args.plot:
        check_plot(args)
    if args.tp > 1 or args.replicas > 1:
        return _run_topology(args, sizes)
    for env in ["sglang"] + (["vllm"] if "vllm" in engines else []):
        env = envs.default_vllm_env() if env == "vllm" else env
        envs.build(env)
    launcher.init_ray(num_cpus=2, log_to_driver=False)
    results = [_bench_size(size, engines, args) for size in sizes]
    ray.shutdown()
    rows = []
    for res in results:
        n = res["nbytes"]
        rows.append(
            [
                res["size"],
                f"{n / 1e9:.3f}",
                "memcpy",
                f"{_gbps(n, res['memcpy_s']):.2f}",
                f"{res['memcpy_s'] * 1e3:.0f}",
            ]
        )
        rows.append(
            [
                res["size"],
                "",
                "transport alone (shm)",
                f"{_gbps(n, res['transport_s']):.2f}",
                f"{res['transport_s'] * 1e3:.0f}",
            ]
        )
        for name, eng in res["engines"].items():
            rows.append(
                [
                    res["size"],
                    "",
                    f"{name}: weightsync sync ({eng.get('path')})",
                    f"{_gbps(n, eng['sync_s']):.2f}",
                    f"{eng['sync_s'] * 1e3:.0f}",
                ]
            )
            rows.append(
                [
                    res["size"],
                    "",
                    f"{name}: + verify (extra; "
                    f"{'verified' if eng['verified'] else 'NOT VERIFIED'})",
                    "",
                    f"{eng['verify_extra_s'] * 1e3:.0f}",
                ]
            )
            if eng.get("background_s"):
                rows.append(
                    [
                        res["size"],
                        "",
                        f"{name}: background after sync (GEMM re-pack)",
                        "",
                        f"{eng['background_s'] * 1e3:.0f}",
                    ]
                )
            for path, seconds in eng["native_s"].items():
                rows.append(
                    [
                        res["size"],
                        "",
                        f"{name}: native {path}",
                        f"{_gbps(n, seconds):.2f}",
                        f"{seconds * 1e3:.0f}",
                    ]
                )
    largest = results[-1]
    summary = {
        "model_size": largest["size"],
        "nbytes": largest["nbytes"],
        "memcpy_gbps": _gbps(largest["nbytes"], largest["memcpy_s"]),
        "transport_gbps": _gbps(largest["nbytes"], largest["transport_s"]),
        "engines": {
            name: {
                "weightsync_gbps": _gbps(largest["nbytes"], eng["sync_s"]),
                "verify_extra_s": eng["verify_extra_s"],
                "verified": eng["verified"],
                "native_gbps": {p: _gbps(largest["nbytes"], s) for p, s in eng["native_s"].items()},
            }
            for name, eng in largest["engines"].items()
        },
        "runs": results,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        header = ["size", "GB", "path", "GB/s", "ms"]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, ["-" * w for w in widths], *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    if args.plot:
        _plot(results, args.plot)
    return 0


def check_plot(args: argparse.Namespace) -> None:
    """Refuse `--plot` before the run (engines take minutes to start), not after it."""
    if args.tp > 1 or args.replicas > 1:
        raise ValueError(
            f"--plot {args.plot}: a topology run (--tp {args.tp} --replicas {args.replicas}) "
            "draws no plot; drop --plot, or run without --tp/--replicas"
        )
    require_plot(args.plot)


def require_plot(path: str) -> None:
    """ValueError unless a plot can be saved at `path`: its folder exists, matplotlib imports."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: folder {folder} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            f"--plot {path} needs matplotlib, which this environment ({sys.executable}) "
            "lacks; install it with `pip install 'weightsync[plot]'`"
        ) from None


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["nbytes"] / 1e9 for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [_gbps(r["nbytes"], r["memcpy_s"]) for r in results], "k--", label="memcpy")
    for name in results[0]["engines"]:
        ax.plot(
            xs,
            [_gbps(r["nbytes"], r["engines"][name]["sync_s"]) for r in results],
            marker="o",
            label=f"{name} weightsync",
        )
        for p in results[0]["engines"][name]["native_s"]:
            ax.plot(
                xs,
                [_gbps(r["nbytes"], r["engines"][name]["native_s"][p]) for r in results],
                marker="x",
                linestyle=":",
                label=f"{name} native {p}",
            )
    ax.set(xlabel="model GB (bf16)", ylabel="GB/s", title="weight sync throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
