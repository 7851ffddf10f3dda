"""Time `placement.prints_from_sent` (what a verified sync by buckets computes on the sending rank
from the sent fingerprints) for one worker of many tensors placed whole in fused parameters.

    .venv/bin/python scripts/prints_bench.py --tensors 70000
"""

from __future__ import annotations

import argparse
import random
import time

from weightsync.wire.placement import prints_from_sent
from weightsync.wire.specs import TensorSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=70_000)
    parser.add_argument("--per-param", type=int, default=3, help="tensors fused per parameter")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
        f"{args.tensors} tensors into {len(prints)} parameters: best {min(times):.3f} s "
        f"({min(times) / args.tensors * 1e6:.2f} us a tensor), each {[round(t, 3) for t in times]}"
    )


if __name__ == "__main__":
    main()
