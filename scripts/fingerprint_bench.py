"""Fingerprint throughput: one large tensor, and many equal tensors batched, on CPU or GPU.

    python scripts/fingerprint_bench.py [--device cuda] [--gb 0.5] [--count 2000]

Prints GB/s for `fingerprint` of one bf16 tensor of `--gb` GB and for `fingerprints` of
`--count` bf16 tensors of 768 x 2048 (an MoE expert's shape), best of 3, after one warm-up
(which builds the per-device tables). Reads only: what a verification pass costs per side.
On a GPU each row is printed twice, hashed by the Triton kernel (weightsync/gpu/word_sums.py)
and by the GEMM it replaces (`fingerprint.KERNEL = False`), and beside them a device copy of
the same bytes (`copy_`: one read and one write of each byte), all in one run.
"""

from __future__ import annotations

import argparse
import time

import torch

from weightsync.wire import fingerprint as fp
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


def _one(numel: int, device: str, how: str) -> None:
    big = torch.randn(numel, device=device).bfloat16()
    seconds = _best(lambda: fingerprint(big), device)
    print(
        f"{how}: one tensor, {numel * 2 / 1e9:.2f} GB: {seconds:.4f} s, "
        f"{numel * 2 / 1e9 / seconds:.1f} GB/s"
    )


def _copy(numel: int, device: str) -> None:
    src = torch.randn(numel, device=device).bfloat16()
    dst = torch.empty_like(src)
    seconds = _best(lambda: dst.copy_(src), device)
    print(f"copy_ of {numel * 2 / 1e9:.2f} GB (read + write): {seconds:.4f} s")


def _sweep(numel: int, count: int) -> None:
    """The kernel (weightsync/gpu/word_sums.py) at several block shapes, one large tensor and
    `count` expert-shaped ones, best of 3 each."""
    from weightsync.gpu import word_sums

    big = torch.randn(numel, device="cuda").bfloat16()
    many = [torch.randn(768, 2048, device="cuda").bfloat16() for _ in range(count)]
    nbytes = sum(t.numel() * 2 for t in many)
    for block, rows, warps in [(1024, 32, 4), (1024, 32, 8), (2048, 32, 8), (512, 32, 4)] + [
        (1024, 64, 4),
        (1024, 16, 4),
        (2048, 64, 8),
    ]:
        word_sums.BLOCK, word_sums.ROWS, word_sums.WARPS = block, rows, warps
        fp._local.__dict__.clear()  # tables and the first-use check, for this shape
        one = _best(lambda: fingerprints([big]), "cuda")
        all_ = _best(lambda: fingerprints(many), "cuda")
        print(
            f"BLOCK={block} ROWS={rows} WARPS={warps}: {numel * 2 / 1e9:.2f} GB in "
            f"{one * 1e3:.2f} ms ({numel * 2 / 1e9 / one:.0f} GB/s); {count} tensors, "
            f"{nbytes / 1e9:.2f} GB in {all_ * 1e3:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="GPU: time the kernel at several block shapes (columns, rows, warps) instead",
    )
    args = parser.parse_args()
    if args.sweep:
        _sweep(int(args.gb * 1e9) // 2, args.count)
        return
    hows = ["kernel", "gemm"] if args.device != "cpu" else ["gemm"]
    numel = int(args.gb * 1e9) // 2
    if args.device != "cpu":
        _copy(numel, args.device)
    many = [torch.randn(768, 2048, device=args.device).bfloat16() for _ in range(args.count)]
    nbytes = sum(t.numel() * 2 for t in many)
    for how in hows:
        fp.KERNEL = how == "kernel"
        _one(numel, args.device, how)
        seconds = _best(lambda: fingerprints(many), args.device)
        print(
            f"{how}: {args.count} tensors of 768 x 2048 bf16, {nbytes / 1e9:.2f} GB: "
            f"{seconds:.4f} s, {nbytes / 1e9 / seconds:.1f} GB/s, "
            f"{seconds / args.count * 1e6:.0f} us per tensor"
        )


if __name__ == "__main__":
    main()
