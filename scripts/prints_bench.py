"""Time what a verified sync by buckets computes on the sending rank from the sent fingerprints
for one worker of many tensors placed whole in fused parameters: `placement.prints_from_sent`
(from a {name: fingerprint} dict, a `WholePrints` plan made for the call; until 137b700 a
Python loop over the tensors) and a kept `WholePrints` plan applied to the sent fingerprints'
table (what each verified sync after the first does);
with `--sliced`, what it computes for a tensor a TP worker holds a transposed slice of (GPT-2's
Conv1D at TP=2: one pattern per row), by `placed_prints` and by `placed` once per pattern.

    .venv/bin/python scripts/prints_bench.py --tensors 70000
    .venv/bin/python scripts/prints_bench.py --sliced 768x2304
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from weightsync.wire.fingerprint import combine, placed
from weightsync.wire.placement import (
    WholePrints,
    pattern_view,
    patterns,
    placed_prints,
    prints_from_sent,
    sent_table,
)
from weightsync.wire.specs import TensorSpec


def sliced(rows: int, cols: int, *, repeats: int) -> None:
    """Worker 1 of 2 holds columns cols/2.. of a [rows, cols] tensor, transposed."""
    tensor = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    half = cols // 2
    dst = torch.arange(half * rows)
    pats = patterns(dst, (dst % rows) * cols + half + dst // rows)
    flat = tensor.reshape(-1)
    by_pattern, together = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        want = combine([placed(pattern_view(flat, p), p[0], p[4]) for p in pats])
        by_pattern.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = placed_prints(flat, pats)
        together.append(time.perf_counter() - start)
        assert got == want
    print(
        f"[{rows}, {cols}] float32, a transposed half ({len(pats)} patterns): `placed` per "
        f"pattern best {min(by_pattern) * 1e3:.1f} ms, `placed_prints` best "
        f"{min(together) * 1e3:.2f} ms (same fingerprint; torch threads {torch.get_num_threads()})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=70_000)
    parser.add_argument("--per-param", type=int, default=3, help="tensors fused per parameter")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sliced", help="IN x OUT: a float32 [IN, OUT] tensor, the last half of OUT"
    )
    args = parser.parse_args()
    if args.sliced:
        return sliced(*(int(n) for n in args.sliced.split("x")), repeats=args.repeats)
    rng = random.Random(0)
    specs, placements, sent = {}, {}, {}
    for i in range(args.tensors):
        name = f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w"
        specs[name] = TensorSpec(name=name, dtype="bfloat16", shape=(8, 16))
        at = (i % args.per_param) * 128
        placements[name] = [f"param{i // args.per_param}", [[at, 0, 128, 1, 0, 0]]]
        sent[name] = (rng.getrandbits(64), rng.randrange(1 << 21), rng.randrange(1 << 21))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        prints = prints_from_sent(placements, sent, specs)
        times.append(time.perf_counter() - start)
    assert prints is not None
    print(
        f"prints_from_sent (a plan made for the call, from a dict): {args.tensors} tensors into {len(prints)} parameters: best "
        f"{min(times):.3f} s ({min(times) / args.tensors * 1e6:.2f} us a tensor), each "
        f"{[round(t, 3) for t in times]}"
    )
    order = list(sent)
    table = sent_table(sent.values())  # as `FingerprintBatch.read_table` holds it
    start = time.perf_counter()
    plan = WholePrints.of(placements, order, specs)
    made = time.perf_counter() - start
    kept = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        got = WholePrints.of(placements, list(order), specs).prints(table)
        kept.append(time.perf_counter() - start)
    assert plan.whole and got == prints
    print(
        f"kept WholePrints: made once in {made:.3f} s; each sync after it best {min(kept):.4f} s "
        f"({min(kept) / args.tensors * 1e6:.2f} us a tensor, the plan looked up included), the "
        f"same fingerprints"
    )


if __name__ == "__main__":
    main()
