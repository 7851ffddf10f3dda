"""The one-time costs that put an engine on the one-copy path, in one process, on a checkpoint
layout's tensors and an engine's fused parameters (weightsync/apps/layouts.py `fused`: q/k/v,
gate/up and every layer's experts in one parameter each):

- learn: `ModelReceiver.learn_placements` over every tensor, a call per bucket of
  `--bucket-mb`, as an engine's first sync by buckets does (a `ModuleWeightReceiver` with
  `sliced=True`, its loader the fused one); the placements found are checked against the
  layout's;
- share: then that receiver's `share()`, as an engine's first one-copy sync does: the
  parameters moved into shared memory (GPU: their storages exported), no probe of the tensors
  learned (the check: its loader did not run, every tensor has an offset);
- probe: `probe_destinations` over every tensor into those parameters, as sharing does when
  nothing was learned (a loader that copies each tensor to its place in its fused parameter);
  the destinations found are checked against the layout's;
- loader: that loader alone over every tensor once (zeros), the floor of both.

  python scripts/share_bench.py --layout mla-moe --shrink 64
  python scripts/share_bench.py --layout qwen3-30b-a3b --layers 2 --shrink 8 --what learn
  python scripts/share_bench.py --device cuda --layout mla-moe --shrink 8

Seconds are wall time of one call over all tensors (best of `--repeats`; learn runs once: it
learns each tensor only once), on one thread on the CPU (`torch.set_num_threads(1)`), after a
device synchronize on a GPU. Building the model and its tensors is not counted. "peak extra
GPU MB": the most GPU memory torch allocated during the step above what it held before it. To compare two
trees, put one on `PYTHONPATH` (e.g. `git archive REV weightsync | tar -x -C build/base`).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from rich.console import Console
from rich.table import Table

from weightsync.apps import layouts
from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.engine.one_copy.segment import probe_destinations
from weightsync.wire.bucket import DEFAULT_BUCKET_BYTES
from weightsync.wire.placement import whole_offset
from weightsync.wire.specs import TensorSpec


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--layout", choices=[n for n in layouts.LAYOUTS if n != "uniform"], default="mla-moe"
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None, help="experts per layer of mla-moe")
    parser.add_argument("--shrink", type=int, default=64)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--what", default="learn,share,probe,loader", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=DEFAULT_BUCKET_BYTES >> 20,
        help="learn: the tensors in buckets of this size, one learning call each",
    )
    args = parser.parse_args()
    what = [w for w in args.what.split(",") if w]
    if args.device == "cpu":
        torch.set_num_threads(1)
    shapes = layouts.layout(
        args.layout, num_layers=args.layers, shrink=args.shrink, num_experts=args.experts
    )
    params_layout, where = layouts.fused(shapes)
    count = len(shapes)
    nbytes = layouts.nbytes(params_layout)
    table = Table(
        title=f"{args.layout} (layers {args.layers or 'all'}, shrink {args.shrink}) on "
        f"{args.device}: {count} tensors, {len(params_layout)} parameters, {nbytes / 1e9:.2f} GB"
    )
    for column in ("step", "seconds", "us a tensor", "right", "peak extra GPU MB"):
        table.add_column(column, justify="right" if column != "step" else "left")
    marks: list[int] = []

    def mark() -> None:
        """The GPU memory allocated now; the peak above it is the next row's."""
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            marks[:] = [torch.cuda.memory_allocated()]

    def row(step: str, seconds: float, right: bool | None) -> None:
        peak = "-"
        if args.device == "cuda" and marks:
            peak = f"{(torch.cuda.max_memory_allocated() - marks[0]) / 1e6:.0f}"
        table.add_row(
            step, f"{seconds:.3f}", f"{seconds / count * 1e6:.1f}", str(right or "-"), peak
        )

    model = layouts.build_module(params_layout, device=args.device)
    params = dict(model.named_parameters())
    specs = {n: TensorSpec(name=n, dtype="bfloat16", shape=s) for n, s in shapes}

    def put(name: str, tensor: torch.Tensor) -> None:
        pname, start = where[name]
        params[pname].data.view(-1)[start : start + tensor.numel()].copy_(tensor.reshape(-1))

    def put_many(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            put(name, tensor)

    if "learn" in what:
        receiver = ModuleWeightReceiver(model, fused=where, sliced=True)
        receiver.check_refit([spec.to_dict() for spec in specs.values()])
        generator = torch.Generator(device=args.device).manual_seed(0)
        tensors = [
            (n, torch.randn(s, device=args.device, generator=generator).to(torch.bfloat16))
            for n, s in shapes
        ]
        buckets: list[list] = [[]]  # as the first sync's buckets bring them
        size = 0
        for pair in tensors:
            if buckets[-1] and size + pair[1].nbytes > args.bucket_mb << 20:
                buckets.append([])
                size = 0
            buckets[-1].append(pair)
            size += pair[1].nbytes
        mark()
        start = time.perf_counter()
        for bucket in buckets:
            receiver.receiver.learn_placements(bucket)
        _sync(args.device)
        seconds = time.perf_counter() - start
        learned = receiver.receiver.placements
        right = all(
            n in learned
            and learned[n][0] == where[n][0]
            and whole_offset(learned[n][1], math.prod(s)) == where[n][1]
            for n, s in shapes
        )
        row("learn placements (first sync)", seconds, right)
        del tensors, buckets
        if "share" in what:  # what the engine then pays to share: no probe of what it learned
            loads = []
            inner = receiver.receiver.sharing.load_fn
            receiver.receiver.sharing.load_fn = lambda pairs: [loads.append(1), inner(pairs)]
            mark()
            start = time.perf_counter()
            answer = receiver.receiver.share()
            _sync(args.device)
            seconds = time.perf_counter() - start
            offsets = (answer.shared or {}).get("offsets", {})
            right = not loads and set(offsets) >= set(specs)
            row("share after learning (no probe)", seconds, right)
            receiver.receiver.close()
        del receiver
    if "probe" in what:
        param_of = {n: [where[n][0]] for n in specs}
        best, found = math.inf, {}
        mark()
        for _ in range(args.repeats):
            _sync(args.device)
            start = time.perf_counter()
            found = probe_destinations(params, param_of, specs, put, put_many)
            _sync(args.device)
            best = min(best, time.perf_counter() - start)
        right = all(found.get(n) == (where[n][0], where[n][1] * 2) for n in specs)
        row("probe destinations (share)", best, right)
    if "loader" in what:
        zeros = [(n, torch.zeros(s, dtype=torch.bfloat16, device=args.device)) for n, s in shapes]
        best = math.inf
        mark()
        for _ in range(args.repeats):
            _sync(args.device)
            start = time.perf_counter()
            put_many(zeros)
            _sync(args.device)
            best = min(best, time.perf_counter() - start)
        row("the loader alone, every tensor once", best, None)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
