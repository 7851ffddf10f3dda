"""CPU syncs of real checkpoint layouts (thousands of tensors), by buckets and by the one-copy
path, beside a memcpy of the same bytes measured in the same run.

  python scripts/cpu_layout_bench.py --layout qwen3-30b-a3b --layers 16 --shrink 4
  python scripts/cpu_layout_bench.py --layout llama8b --shrink 4
  python scripts/cpu_layout_bench.py --device cuda --ranks 1 --shrink 1 --layout llama8b

`--device cuda` runs the same on a GPU: ranks and receiver on GPUs, transport `cuda_ipc`, the
one-copy path writing into the receiver's exported CUDA storages (weightsync/engine/one_copy/cuda_exports.py);
memcpy is then a device-to-device copy, and peak GPU memory growth is reported on both sides.

The trainer is `TrainerSync` on 2 FSDP2 ranks (gloo, bf16, one thread each), over a model with
the names and shapes of weightsync/apps/layouts.py (`--shrink` divides every width, the tensor count
stays the real model's; random values). The receiver is a `ModuleWeightReceiver` holding
parameters of the same names in another process, reached over a pipe. Each path gets a fresh
receiver and trainer sync:
- buckets: both ranks write their shards into shared-memory buckets, the receiver copies every
  tensor out into its parameters (two copies of every byte);
- p2p (`--paths p2p`): after a first sync by buckets (the receiver learns where each tensor
  lands), both ranks send their own shards to the receiver process over gloo (NCCL with
  `--device cuda`), one message per rank; the receiver writes each piece into its parameter
  (weightsync/trainer/p2p_path.py; two copies of every byte, one of them through a socket);
- one_copy: after two warm-up syncs (the first by buckets, after which the receiver shares its
  parameters; the second maps them into the ranks) both ranks write their shards straight into
  the receiver's parameters (weightsync/trainer/one_copy/targets.py; one copy of every byte).
Measured per path:
- memcpy: one torch `copy_` of a buffer of the layout's size in rank 0's process, on all cores,
  best of `--repeats + 2`, measured just before the path's syncs and again after them (the other
  ranks at a barrier, the receiver stopped): the faster of the two is the reference;
- sync: rank 0's wall time of `TrainerSync.sync()` (everything: the plan broadcast, begin, both
  ranks' writes, the receiver's copies on the bucket path, end), best of `--repeats`, the ranks
  lined up by a barrier before each; ratio = memcpy seconds / sync seconds;
- each rank's CPU seconds in a sync (its process, best of `--repeats`): on a loaded host the
  wall clock counts other processes' turns too, CPU seconds do not;
- peak RSS growth of each process during the timed syncs, and the shared-memory segments the
  three processes hold (buckets, the receiver's shared parameters);
- whether an unverified sync like the timed ones, after every parameter was negated in place,
  left the receiver holding the new values (`TrainerSync.verify`), and a verified sync;
- verified syncs timed the same way (best of `--repeats`): what verification adds to a sync,
  and whether the write plan verified them (GPU: one fused copy-and-read-back kernel).
`--profile DIR` writes each rank's cProfile (CPU time) of the timed syncs of each path, and the
receiver's (wall time, from the first timed sync to the last rank's dump); the verified syncs
likewise, in `PATH-verified-*.prof`. With `WEIGHTSYNC_PROFILE_SHARE=FILE` in the environment
the receiver's sharing (`share_params`) runs under cProfile and its 40 costliest calls (by
cumulative time) go to FILE. `--trace DIR` (GPU): after the verified syncs, one more
sync and one more verified sync under torch.profiler (host and device time) on rank 0 and in the
receiver: each side's table of ops by device time (`PATH-SYNC-SIDE.txt`) and its timeline
(`PATH-SYNC-SIDE.json.gz`, chrome://tracing). Progress goes to stderr as the run goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import PipeEndpoint, stop_receiver, timed_copy  # noqa: E402

from weightsync.apps import layouts  # noqa: E402
from weightsync.trainer.endpoint import Endpoint  # noqa: E402

PATHS = ("buckets", "one_copy", "p2p")


class _PipeEndpoint(PipeEndpoint, Endpoint):
    """gpu_bench's pipe endpoint, as the `Endpoint` that `TrainerSync.connect` takes."""


_T0 = time.perf_counter()


def _say(rank: int, message: str) -> None:
    """Progress on rank 0, on stderr (a run stopped by a time limit shows how far it got)."""
    if rank == 0:
        print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


def _gpu_reset() -> int:
    """Reset this process's peak GPU memory; the bytes allocated now."""
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


_receiver_profile: list = []


def _profile_start() -> None:
    _receiver_profile[:] = [cProfile.Profile()]  # wall time: the receiver mostly waits
    _receiver_profile[0].enable()


def _profile_dump(path: str) -> None:
    _receiver_profile[0].disable()
    _receiver_profile[0].dump_stats(path)


_receiver_trace: list = []


def _trace_start() -> None:
    _receiver_trace[:] = [_torch_profiler()]
    _receiver_trace[0].__enter__()


def _trace_dump(path: str) -> None:
    _trace_write(_receiver_trace.pop(), path)


def _torch_profiler():
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _trace_write(prof, path: str) -> None:
    """End `prof` (entered) and write PATH.txt (ops by device time) and PATH.json.gz."""
    import gzip
    import shutil

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    with open(f"{path}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
        f.write("\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    prof.export_chrome_trace(f"{path}.json")
    with open(f"{path}.json", "rb") as src, gzip.open(f"{path}.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(f"{path}.json")


# Calls the receiver process answers itself (not its receiver).
_PROCESS_CALLS = {
    "pid": os.getpid,
    "gpu_reset": _gpu_reset,
    "gpu_peak": lambda: torch.cuda.max_memory_allocated(),
    "profile_start": _profile_start,
    "profile_dump": _profile_dump,
    "trace_start": _trace_start,
    "trace_dump": _trace_dump,
}


def _receiver_main(
    shapes: layouts.Layout,
    conn,
    device: str = "cpu",
    receiver_layout: str = "checkpoint",
    sliced: bool = False,
) -> None:
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.errors import error_to_wire

    torch.set_num_threads(1)
    if receiver_layout == "fused":  # an engine's parameters: q/k/v, gate/up, experts fused
        params, where = layouts.fused(shapes)
        receiver = ModuleWeightReceiver(
            layouts.build_module(params, device=device), name="receiver", fused=where
        )
    else:
        receiver = ModuleWeightReceiver(
            layouts.build_module(shapes, device=device), name="receiver", sliced=sliced
        )
    while (item := conn.recv()) is not None:
        method, args = item
        try:
            if method in _PROCESS_CALLS:
                result = _PROCESS_CALLS[method](*args)
            elif method == "share_params" and os.environ.get(PROFILE_SHARE):
                result = _profiled(getattr(receiver, method), args, os.environ[PROFILE_SHARE])
            else:
                result = getattr(receiver, method)(*args)
            conn.send(("ok", result))
        except Exception as exc:  # reported to the sender as plain data
            conn.send(("error", error_to_wire(exc)))
    receiver.receiver.close()


PROFILE_SHARE = "WEIGHTSYNC_PROFILE_SHARE"  # a path: the receiver's share under cProfile


def _profiled(fn, args, path: str):
    """`fn(*args)` under cProfile; the 40 entries with the most cumulative time to `path`."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(fn, *args)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
    with open(path, "a") as f:
        f.write(out.getvalue())
    return result


def memcpy_s(nbytes: int, repeats: int, device: str = "cpu") -> float:
    """Seconds of one torch copy_ of `nbytes` bytes between two buffers, best of `repeats`, on
    all of this host's cores (as fast as or faster than on one: the stricter floor). On a GPU:
    a device-to-device copy of at most 8 GB, its rate scaled to `nbytes` (both models already
    fill the GPU)."""
    if device == "cuda":
        size = min(nbytes, 8 << 30)
        src = torch.ones(size, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        best = timed_copy(dst, src, repeats)
        del src, dst
        torch.cuda.empty_cache()
        return best * nbytes / size
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the destination's pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return best


def _reset_peak_rss(pids: list[int]) -> list[int]:
    """Reset each process's resident-memory high-water mark; its resident bytes now."""
    for pid in pids:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def _peak_rss(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            out += [int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:")]
    return out


def _segment_bytes(pids: list[int]) -> int:
    """Bytes of the weightsync shared-memory segments these processes made (buckets, or the
    receiver's shared parameters)."""
    from weightsync.transports.shm import PREFIX, SHM_DIR, list_segments

    ours = tuple(f"{PREFIX}{pid}-" for pid in pids)
    return sum(
        os.path.getsize(os.path.join(SHM_DIR, n)) for n in list_segments() if n.startswith(ours)
    )


def _dump_profiles(
    profile: cProfile.Profile, folder: str, name: str, rank: int, engines: dict
) -> None:
    """This rank's profile as NAME-rankR.prof in `folder`; rank 0 has the receiver write its
    own as NAME-receiver.prof."""
    os.makedirs(folder, exist_ok=True)
    profile.dump_stats(os.path.join(folder, f"{name}-rank{rank}.prof"))
    if rank == 0:
        where = os.path.abspath(os.path.join(folder, f"{name}-receiver.prof"))
        engines["receiver"].call("profile_dump", where, timeout_s=60)


def _traced_sync(sync, path: str, verify: bool, *, rank: int, folder: str, engines: dict) -> None:
    """One more sync under torch.profiler on rank 0 and in the receiver (`--trace`)."""
    import torch.distributed as dist

    name = os.path.join(os.path.abspath(folder), f"{path}-{'verified' if verify else 'sync'}")
    os.makedirs(folder, exist_ok=True)
    dist.barrier()
    prof = None
    if rank == 0:
        engines["receiver"].call("trace_start", timeout_s=60)
        prof = _torch_profiler()
        prof.__enter__()
    sync.sync(f"traced-{int(verify)}", verify=verify)
    if prof is not None:
        _trace_write(prof, f"{name}-rank0")
        engines["receiver"].call("trace_dump", f"{name}-receiver", timeout_s=600)
    _say(rank, f"{path}: traced {'verified ' if verify else ''}sync written to {name}-*")


def _bench_path(
    path: str,
    model: torch.nn.Module,
    shapes: layouts.Layout,
    *,
    rank: int,
    args: argparse.Namespace,
    trainer_pids: list[int],
) -> dict | None:
    import torch.distributed as dist

    from weightsync import SyncOptions, TrainerSync

    transport = "cuda_ipc" if args.device == "cuda" else "shm"
    sync = TrainerSync(
        model,
        options=SyncOptions(
            transport=transport,
            shard_writes=not args.no_shard_writes,
            bucket_bytes=args.bucket_mb << 20,
            one_copy=path == "one_copy",
            point_to_point=path == "p2p",
            timeout_s=600,
            verify=False,  # the timed syncs; verified ones ask for it
        ),
    )
    engines, child = {}, None
    if rank == 0:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        # daemon: should this rank fail, its exit does not wait for the receiver
        child = ctx.Process(
            target=_receiver_main,
            # p2p: the checkpoint-shaped receiver learns its placements in the first sync
            args=(shapes, there, args.device, args.receiver, path == "p2p"),
            daemon=True,
        )
        child.start()
        engines = {"receiver": _PipeEndpoint(here, "receiver")}
    sync.connect(engines)
    _say(rank, f"{path}: connected")
    expected = path if path in ("one_copy", "p2p") else "buckets"
    warm = [sync.sync(f"warm-{i}") for i in range(2)]
    _say(rank, f"{path}: two warm-up syncs done (the first shares, where it can)")
    pids = trainer_pids + ([engines["receiver"].call("pid", timeout_s=60)] if rank == 0 else [])
    dist.barrier()
    rss = _reset_peak_rss(pids) if rank == 0 else []
    gpu = args.device == "cuda"
    gpu_base = [_gpu_reset()] if gpu else []
    if gpu and rank == 0:
        gpu_base.append(engines["receiver"].call("gpu_reset", timeout_s=60))
    # CPU time, not wall: on a shared host the wall clock also counts other processes' turns.
    profile = cProfile.Profile(time.process_time) if args.profile else None
    if profile is not None and rank == 0:
        engines["receiver"].call("profile_start", timeout_s=60)
    times, cpu_times, reports = [], [], []
    for i in range(args.repeats):
        dist.barrier()
        if profile is not None:
            profile.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        report = sync.sync(f"v{i}")
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
        if profile is not None:
            profile.disable()
        reports.append(report)
    _say(rank, f"{path}: timed syncs {[round(t, 4) for t in times]}")
    rank_cpu_s: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(rank_cpu_s, min(cpu_times))
    if profile is not None:
        _dump_profiles(profile, args.profile, path, rank, engines)
    peak = _peak_rss(pids) if rank == 0 else []
    gpu_growth = {}
    if gpu and rank == 0:
        peaks = [
            torch.cuda.max_memory_allocated(),
            engines["receiver"].call("gpu_peak", timeout_s=60),
        ]
        gpu_growth = {n: p - b for n, p, b in zip(("rank0", "receiver"), peaks, gpu_base)}
    segments = _segment_bytes(pids) if rank == 0 else 0
    # What the timed (unverified) syncs write, checked: new values in place, one more such
    # sync, then a verification that writes nothing.
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().neg_()
    sync.sync("negated")
    after_timed = sync.verify()
    checked = sync.sync("checked", verify=True)
    # Verified syncs, timed the same way (what verification adds to a sync).
    verified_times = []
    vprofile = cProfile.Profile(time.process_time) if args.profile else None
    if vprofile is not None and rank == 0:
        engines["receiver"].call("profile_start", timeout_s=60)
    for i in range(args.repeats):
        dist.barrier()
        if vprofile is not None:
            vprofile.enable()
        start = time.perf_counter()
        report = sync.sync(f"verified-{i}", verify=True)
        verified_times.append(time.perf_counter() - start)
        if vprofile is not None:
            vprofile.disable()
        if report is not None and not report.verify["receiver"].verified:  # rank 0
            raise RuntimeError(f"{path}: verified sync {i} failed: {report.verify}")
    _say(rank, f"{path}: verified syncs {[round(t, 4) for t in verified_times]}")
    if vprofile is not None:
        _dump_profiles(vprofile, args.profile, f"{path}-verified", rank, engines)
    if args.trace:
        for verify in (False, True):
            _traced_sync(sync, path, verify, rank=rank, folder=args.trace, engines=engines)
    plan = sync.one_copy_path.writer.plan
    plan_verifies = bool(path == "one_copy" and getattr(plan, "dsts", None) and plan.checks)
    sync.close()
    if rank != 0:
        return None
    stop_receiver(engines["receiver"], child)
    paths = sorted({r.path for r in reports})
    if paths != [expected]:
        raise RuntimeError(f"{path}: the timed syncs took {paths}, expected [{expected!r}]")
    best = min(range(len(times)), key=times.__getitem__)
    return {
        "sync_s": times[best],
        "report_sync_s": reports[best].sync_s,
        "phases_s": reports[best].phases_s,
        "times_s": times,
        "rank_cpu_s": rank_cpu_s,
        "verified": checked.verify["receiver"].verified,
        "verified_sync_s": min(verified_times),
        "verify_added": min(verified_times) / times[best] - 1,
        "verified_through_plan": plan_verifies,
        "unverified_sync_checked": after_timed["receiver"].verified,
        "share_s": warm[0].engines["receiver"].share_s,
        "peak_rss_growth_bytes": {
            name: p - r
            for name, p, r in zip(
                [f"rank{i}" for i in range(len(trainer_pids))] + ["receiver"], peak, rss
            )
        },
        "segment_bytes": segments,
        "peak_gpu_growth_bytes": gpu_growth,
    }


def _rank_main(rank: int, port: int, args: argparse.Namespace, results) -> None:
    try:
        _rank(rank, port, args, results)
    except BaseException:
        import traceback

        results.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def _rank(rank: int, port: int, args: argparse.Namespace, results) -> None:
    import torch.distributed as dist

    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    torch.set_num_threads(1)
    init_trainer_group(rank=rank, world_size=args.ranks, master_addr="127.0.0.1", master_port=port)
    shapes = layouts.layout(
        args.layout, num_layers=args.layers, shrink=args.shrink, num_experts=args.experts
    )
    nbytes = layouts.nbytes(shapes)
    start = time.perf_counter()
    model = shard_model(
        layouts.build_module(shapes, fill=True, seed=0, device=args.device), device=args.device
    )
    built_s = time.perf_counter() - start
    _say(rank, f"{len(shapes)} tensors built and sharded in {built_s:.1f} s")
    pids: list[int] = [0] * args.ranks
    dist.all_gather_object(pids, os.getpid())
    out = {
        "layout": args.layout,
        "layers": args.layers,
        "experts": args.experts,
        "shrink": args.shrink,
        "receiver": args.receiver,
        "tensors": len(shapes),
        "gb": nbytes / 1e9,
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "build_and_shard_s": built_s,
        "paths": {},
    }
    for path in args.paths:
        # memcpy beside each path, in the same conditions: before its syncs and after them
        # (the receiver stopped, the other ranks at a barrier); the faster is the reference.
        before = memcpy_s(nbytes, args.repeats + 2, args.device) if rank == 0 else None
        dist.barrier()
        result = _bench_path(path, model, shapes, rank=rank, args=args, trainer_pids=pids)
        if rank == 0:
            after = memcpy_s(nbytes, args.repeats + 2, args.device)
            out["paths"][path] = {
                "memcpy_s": min(before, after),
                "memcpy_before_after_s": [before, after],
                **result,
            }
        dist.barrier()
    close_trainer_group()
    if rank == 0:
        results.put(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [
        ctx.Process(target=_rank_main, args=(r, port, args, results)) for r in range(args.ranks)
    ]
    for p in ranks:
        p.start()
    out = results.get(timeout=3600)
    if "error" in out:  # the other rank waits in a collective: end both
        for p in ranks:
            p.kill()
        raise RuntimeError(out["error"])
    for p in ranks:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"trainer rank process {p.pid} exited with {p.exitcode}")
    return out


def _table(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{out['layout']}, {out['layers'] or 'all'} layers, widths / "
        f"{out['shrink']}: {out['tensors']} tensors, {out['gb']:.3f} GB bf16; "
        f"best of {out['repeats']}"
    )
    for col in (
        "path",
        "sync s (TrainerSync.sync wall, rank 0)",
        "memcpy s (same bytes)",
        "ratio (memcpy s / sync s)",
        "us per tensor beyond memcpy",
        "phases s (begin / write / end)",
        "rank CPU s (0 / 1)",
        "verified (after / sync)",
        "verified sync s (added)",
        "peak RSS growth MB (ranks / receiver)",
        "shm segments MB",
        "peak GPU growth MB (rank0 / receiver)",
    ):
        left = col in ("path", "verified (after / sync)")
        table.add_column(col, justify="left" if left else "right")
    for path, r in out["paths"].items():
        phases = r["phases_s"] or {}
        growth = r["peak_rss_growth_bytes"]
        table.add_row(
            path,
            f"{r['sync_s']:.3f}",
            f"{r['memcpy_s']:.3f}",
            f"{r['memcpy_s'] / r['sync_s']:.2f}",
            f"{(r['sync_s'] - r['memcpy_s']) / out['tensors'] * 1e6:.0f}",
            " / ".join(f"{phases[k]:.3f}" for k in ("begin", "write", "end") if k in phases) or "-",
            " / ".join(f"{c:.3f}" for c in r["rank_cpu_s"]),
            f"{r.get('unverified_sync_checked')} / {r['verified']}",
            f"{r['verified_sync_s']:.3f} ({r['verify_added']:+.0%})",
            " / ".join(f"{v / 1e6:.0f}" for v in growth.values()),
            f"{r['segment_bytes'] / 1e6:.0f}",
            " / ".join(f"{v / 1e6:.0f}" for v in r["peak_gpu_growth_bytes"].values()) or "-",
        )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--layout", choices=[n for n in layouts.LAYOUTS if n != "uniform"], default="qwen3-30b-a3b"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layer count (default: the model's own)"
    )
    parser.add_argument(
        "--experts", type=int, default=None, help="experts per MoE layer of mla-moe (384)"
    )
    parser.add_argument(
        "--shrink",
        type=int,
        default=4,
        help="divide every width (hidden, heads, intermediate, vocabulary) by this",
    )
    parser.add_argument(
        "--paths",
        default="buckets,one_copy",
        help="comma-separated: buckets, one_copy, p2p (SyncOptions.point_to_point: every rank "
        "sends its own shards to the receiver over gloo, or NCCL with --device cuda)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: trainer ranks and receiver on GPUs, transport cuda_ipc "
        "(one-copy: the receiver exports its parameters' CUDA storages)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (FSDP2)")
    parser.add_argument(
        "--receiver",
        choices=["checkpoint", "fused"],
        default="checkpoint",
        help="the receiver's parameters: the checkpoint's tensors one for one, "
        "or fused as an engine holds them (vLLM's layout: q/k/v, gate/up "
        "and every layer's experts in one parameter each)",
    )
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument(
        "--no-shard-writes",
        action="store_true",
        help="SyncOptions(shard_writes=False): rank 0 sends full tensors, one gather each",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write each rank's cProfile of the timed syncs of each path here",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="GPU: one more sync and verified sync of each path under torch.profiler on rank 0 "
        "and the receiver, written here (ops by device time, and timelines)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    args = parser.parse_args()
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}; choose from {list(PATHS)}")
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _table(out)


if __name__ == "__main__":
    main()
