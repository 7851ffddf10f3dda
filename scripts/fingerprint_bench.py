"""Fingerprint throughput: one large tensor, and many equal tensors batched, on CPU or GPU.

    python scripts/fingerprint_bench.py [--device cuda] [--gb 0.5] [--count 2000]

Prints GB/s for `fingerprint` of one bf16 tensor of `--gb` GB and for `fingerprints` of
`--count` bf16 tensors of 768 x 2048 (an MoE expert's shape), best of 3, after one warm-up
(which builds the per-device tables). Reads only: what a verification pass costs per side.
"""

from __future__ import annotations

import argparse
import time

import torch

from weightsync.wire.fingerprint import fingerprint, fingerprints


def _best(fn, device: str) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _one(numel: int, device: str) -> None:
    big = torch.randn(numel, device=device).bfloat16()
    seconds = _best(lambda: fingerprint(big), device)
    print(
        f"one tensor, {numel * 2 / 1e9:.2f} GB: {seconds:.4f} s, "
        f"{numel * 2 / 1e9 / seconds:.1f} GB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    _one(int(args.gb * 1e9) // 2, args.device)
    many = [torch.randn(768, 2048, device=args.device).bfloat16() for _ in range(args.count)]
    nbytes = sum(t.numel() * 2 for t in many)
    seconds = _best(lambda: fingerprints(many), args.device)
    print(
        f"{args.count} tensors of 768 x 2048 bf16, {nbytes / 1e9:.2f} GB: {seconds:.4f} s, "
        f"{nbytes / 1e9 / seconds:.1f} GB/s, {seconds / args.count * 1e6:.0f} us per tensor"
    )


if __name__ == "__main__":
    main()
