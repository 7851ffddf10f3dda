"""CUDA IPC syncs of real checkpoint layouts (many tensors of real shapes), beside the device's
copy rate measured in the same run.

  python scripts/gpu_layout_bench.py --layout llama8b
  python scripts/gpu_layout_bench.py --layout qwen3-30b-a3b --layers 24,48

The sender is the real WeightSender (refit check, begin, buckets, end) over the trainer's bf16
tensors (random values, names and shapes of weightsync/apps/layouts.py); the receiver a
ModuleWeightReceiver with parameters of the same names in another process on the same GPU, which
copies every tensor into them as an engine's default loader does. A sync ends when the
receiver's copies are done. Reference: the GPU's device-to-device copy rate, measured on a
`--reference-gb` buffer (the layouts are too large to copy a second time beside both models).
Prints one JSON line per layout size: tensors, GB, best sync seconds, the ratio of the sync's
rate to the copy rate, a verified sync's seconds, and peak extra GPU memory during a sync on each
side (beyond both models).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import PipeEndpoint, stop_receiver, timed_copy  # noqa: E402

from weightsync.apps import layouts  # noqa: E402


def _receiver_main(
    shapes: layouts.Layout, conn, one_copy_bytes: int | None = None, graphs: bool = True
) -> None:
    torch.cuda.set_device(0)
    from weightsync.gpu import copies

    copies.GRAPHS = graphs
    if os.environ.get("WS_GRAPH_BRANCHES"):  # experiments only
        copies.GRAPH_BRANCHES = int(os.environ["WS_GRAPH_BRANCHES"])
    if one_copy_bytes is not None:
        copies.ONE_COPY_BYTES = one_copy_bytes
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.errors import error_to_wire

    receiver = ModuleWeightReceiver(layouts.build_module(shapes, device="cuda:0"), name="receiver")
    while (item := conn.recv()) is not None:
        method, args = item
        try:
            if method == "peak_reset":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                result = torch.cuda.memory_allocated()
            elif method == "peak":
                result = torch.cuda.max_memory_allocated()
            elif method == "prof_start":  # --profile: host (cProfile) and device time
                import cProfile

                prof = cProfile.Profile()
                tprof = torch.profiler.profile(
                    activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        torch.profiler.ProfilerActivity.CUDA,
                    ]
                )
                tprof.__enter__()
                prof.enable()
                result = None
            elif method == "prof_stop":
                import io
                import pstats

                prof.disable()
                torch.cuda.synchronize()
                tprof.__exit__(None, None, None)
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                result = out.getvalue() + tprof.key_averages().table(
                    sort_by="self_cuda_time_total", row_limit=12
                )
            else:
                result = getattr(receiver, method)(*args)
                if method == "end":  # the update is done once its copies are
                    torch.cuda.synchronize()
            conn.send(("ok", result))
        except Exception as exc:  # reported to the sender as plain data
            conn.send(("error", error_to_wire(exc)))
    receiver.receiver.close()


class _Source:
    def __init__(self, module: torch.nn.Module) -> None:
        self.params = list(module.named_parameters())

    def tensors(self):
        return iter(self.params)


def copy_rate(gb: float, repeats: int) -> float:
    """Device-to-device copy rate (GB/s) of one buffer of `gb` GB, best of `repeats`."""
    src = torch.empty(int(gb * 1e9), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = timed_copy(dst, src, repeats)
    del src, dst
    torch.cuda.empty_cache()
    return gb / best


def run(
    layout: str,
    num_layers: int | None,
    *,
    repeats: int,
    bucket_bytes: int,
    reference_gbps: float,
    replay: bool = True,
    one_copy_bytes: int | None = None,
    profile: bool = False,
    graphs: bool = True,
) -> dict:
    from weightsync.trainer.sender import WeightSender
    from weightsync.transports.cuda_ipc import CudaIpcSender
    from weightsync.wire.specs import TensorSpec

    torch.cuda.set_device(0)
    shapes = layouts.layout(layout, num_layers=num_layers)
    nbytes = layouts.nbytes(shapes)
    source = _Source(layouts.build_module(shapes, device="cuda:0", fill=True))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(shapes, there, one_copy_bytes, graphs))
    child.start()
    endpoint = PipeEndpoint(here, "receiver")
    transport = CudaIpcSender(num_slots=2, replay=replay)
    sender = WeightSender(
        [TensorSpec.of(n, t) for n, t in source.params],
        transport=transport,
        capacity_bytes=bucket_bytes,
        timeout_s=600,
    )
    sender.add_engine(endpoint)
    sender.sync(source.tensors(), version="warmup")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    receiver_base = endpoint.call("peak_reset", timeout_s=60)
    times, load_s = [], []
    for i in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        report = sender.sync(source.tensors(), version=f"v{i}")
        times.append(time.perf_counter() - start)
        load_s.append(report.engines[endpoint.name].load_s)
    if profile:  # one more replay sync, profiled on both sides (after the timed ones)
        import cProfile
        import pstats

        endpoint.call("prof_start", timeout_s=60)
        prof = cProfile.Profile()
        prof.enable()
        sender.sync(source.tensors(), version="profiled")
        prof.disable()
        print("== sender", file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(18)
        print("== receiver\n" + endpoint.call("prof_stop", timeout_s=600), file=sys.stderr)
    sender_peak = torch.cuda.max_memory_allocated() - base
    receiver_peak = endpoint.call("peak", timeout_s=60) - receiver_base
    for _, tensor in source.params:  # new values at the same places: replayed syncs must
        tensor.neg_()  # carry them (checked by the verified syncs below)
    verified_times = []
    for i in range(repeats):  # the first also builds each side's fingerprint tables
        torch.cuda.synchronize()
        start = time.perf_counter()
        report = sender.sync(source.tensors(), version=f"verified-{i}", verify=True)
        verified_times.append(time.perf_counter() - start)
    verify_sync_s = min(verified_times)
    verified = report.verify[endpoint.name].verified
    stop_receiver(endpoint, child)
    sender.close()
    best = min(times)
    return {
        "layout": layout,
        "layers": num_layers,
        "tensors": len(shapes),
        "gb": nbytes / 1e9,
        "bucket_mb": bucket_bytes >> 20,
        "sync_s": best,
        "receiver_load_s": load_s[times.index(best)],
        "sync_gbps": nbytes / best / 1e9,
        "copy_gbps": reference_gbps,
        "ratio": nbytes / best / 1e9 / reference_gbps,
        "verified_sync_s": verify_sync_s,
        "verify_added": verify_sync_s / best - 1,
        "verified": verified,
        "replay": replay,
        "graphs": graphs,
        "one_copy_bytes": one_copy_bytes,
        "sender_peak_extra_gb": sender_peak / 1e9,
        "receiver_peak_extra_gb": receiver_peak / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--layout", choices=layouts.LAYOUTS, default="llama8b")
    parser.add_argument(
        "--layers", default="", help="comma-separated layer counts (default: the model's own)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--reference-gb", type=float, default=8.0)
    parser.add_argument(
        "--one-copy-mb",
        type=float,
        default=None,
        help="the receiver copies tensors this large one by one, smaller ones "
        "together (default: weightsync.engine.loading's 4 MiB)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed syncs, profile one more (cProfile on both sides, "
        "torch.profiler's device time on the receiver) to stderr",
    )
    parser.add_argument(
        "--no-graphs",
        action="store_true",
        help="the receiver issues a replayed bucket's copies one by one instead "
        "of as one CUDA graph",
    )
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="describe every bucket in full every sync (CUDA IPC replay off)",
    )
    args = parser.parse_args()
    reference = copy_rate(args.reference_gb, args.repeats + 2)
    for layers in [int(x) for x in args.layers.split(",") if x] or [None]:
        print(
            json.dumps(
                run(
                    args.layout,
                    layers,
                    repeats=args.repeats,
                    bucket_bytes=args.bucket_mb << 20,
                    reference_gbps=reference,
                    replay=not args.no_replay,
                    profile=args.profile,
                    graphs=not args.no_graphs,
                    one_copy_bytes=None
                    if args.one_copy_mb is None
                    else int(args.one_copy_mb * (1 << 20)),
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
