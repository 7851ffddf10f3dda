"""Weighted sums of many tensors' words in one pass on a GPU (the fingerprints' arithmetic).

weightsync/wire/fingerprint.py defines a tensor's fingerprint from rows of at most `ROW` words:
for each row, the plain sum of its words and two sums of word j times a weight w_c[j] (the
powers of a root mod a prime). There the rows are widened to float64 in scratch memory and
multiplied by the weight table with a GEMM: on a GPU that writes and reads 4 bytes of scratch
for every byte hashed. Here one Triton kernel reads every word once, straight from the tensors
(any number of them, of any lengths, in one launch), and keeps the weights in registers.

Each program takes one block of `BLOCK` columns and `ROWS` consecutive rows: it loads the
weights of its columns once and, `TILE` rows at a time, those rows' words in its columns,
widened to float64 in registers; it writes the three partial sums of each row. Every product is an integer
below 2**36 and every row's sum below 2**52 in magnitude, so float64 holds the partial sums
exactly, and summing them over the column blocks (`row_sums`) gives each row's exact sums in
any order: the same integers the GEMM gives, on any GPU.

Needs Triton (shipped with CUDA builds of torch); `available()` is false where it cannot compile
or run, and callers keep the GEMM.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ROW = 1 << 16  # words per row (the fingerprint's row length)
BLOCK = 1024  # columns a program takes
ROWS = 32  # rows a program takes, `TILE` at a time
TILE = 8  # rows loaded and reduced together
WARPS = 8

_kernel: list = []
_checked: set[torch.device] = set()


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def weighted_sums(
        starts,
        lengths,
        weights,
        partial,
        num_rows,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        TILE: tl.constexpr,
        BYTES: tl.constexpr,
    ):
        block = tl.program_id(0)
        group = tl.program_id(1)
        column = block * BLOCK + tl.arange(0, BLOCK)
        w1 = tl.load(weights + column)[None, :]
        w2 = tl.load(weights + ROW + column)[None, :]
        blocks = ROW // BLOCK
        for t in range(ROWS // TILE):
            row = group * ROWS + t * TILE + tl.arange(0, TILE)
            real = row < num_rows
            start = tl.load(starts + row, mask=real, other=0)
            n = tl.load(lengths + row, mask=real, other=0)
            if BYTES:
                words = start.to(tl.pointer_type(tl.uint8))
            else:
                words = start.to(tl.pointer_type(tl.int16))
            inside = column[None, :] < n[:, None]
            x = tl.load(words[:, None] + column[None, :], mask=inside, other=0).to(tl.float64)
            out = partial + (row * blocks + block) * 3
            tl.store(out, tl.sum(x, axis=1), mask=real)
            tl.store(out + 1, tl.sum(x * w1, axis=1), mask=real)
            tl.store(out + 2, tl.sum(x * w2, axis=1), mask=real)

    return weighted_sums


def available() -> bool:
    """Whether Triton is importable and a GPU is visible (the kernel is compiled and checked
    against the plain arithmetic at its first use on each device)."""
    if not _kernel:
        kernel = None
        if torch.cuda.is_available():
            try:
                kernel = _build()
            except ImportError:
                kernel = None
        _kernel.append(kernel)
    return _kernel[0] is not None


def row_sums(
    starts: list[int], counts: list[int], *, byte_words: bool, weights: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """For flat runs of words at device addresses `starts` (`counts[i]` words each; bytes if
    `byte_words`, else 16-bit words; the caller keeps their memory alive until the sums are
    read) and `weights` ([2, ROW] float64 on their device: the two weight rows): (sums, tensor,
    row) where `sums` is [rows, 3] int64, the plain and the two weighted sums of every row of
    ROW words (a run's last row is shorter), `tensor` the index of each row's run and `row` the
    row's index within it. Asynchronous: nothing is read back to the host."""
    fn = _ensure(weights.device)
    if fn is None:
        raise RuntimeError("the GPU word-sum kernel does not run here (see `available`)")
    return _row_sums(fn, starts, counts, byte_words, weights)


def _row_sums(
    fn, starts: list[int], counts: list[int], byte_words: bool, weights: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    device = weights.device
    size = 1 if byte_words else 2
    at = torch.tensor(starts, dtype=torch.int64)
    count = torch.tensor(counts, dtype=torch.int64)
    per = (count + ROW - 1) // ROW
    tensor = torch.repeat_interleave(torch.arange(len(starts)), per)
    first = torch.cumsum(per, 0) - per
    row = torch.arange(tensor.numel()) - first[tensor]
    table = torch.stack(
        [
            at[tensor] + row * (ROW * size),
            torch.clamp(count[tensor] - row * ROW, max=ROW),
            tensor,
            row,
        ]
    ).to(device, non_blocking=True)
    num_rows = tensor.numel()
    partial = torch.empty((num_rows, ROW // BLOCK, 3), dtype=torch.float64, device=device)
    if num_rows:
        with torch.cuda.device(device):
            fn[(ROW // BLOCK, -(-num_rows // ROWS))](
                table[0],
                table[1],
                weights,
                partial,
                num_rows,
                ROW=ROW,
                BLOCK=BLOCK,
                ROWS=ROWS,
                TILE=TILE,
                BYTES=byte_words,
                num_warps=WARPS,
            )
    return partial.sum(1).to(torch.int64), table[2], table[3]


def _ensure(device: torch.device):
    """The kernel, compiled and checked on `device` (None where it cannot run)."""
    if not available():
        return None
    fn = _kernel[0]
    if device in _checked:
        return fn
    try:
        _try(fn, device)
    except Exception as exc:  # noqa: BLE001 - any failure to compile or run: keep the GEMM
        logger.warning(
            "the GPU word-sum kernel does not run here (%s: %s); fingerprints use the GEMM",
            type(exc).__name__,
            str(exc)[:300],
        )
        _kernel[0] = None
        return None
    _checked.add(device)
    return fn


def _try(fn, device: torch.device) -> None:
    """Run the kernel on a few tensors (both word sizes, a row and a half, an empty one) and
    compare with the same sums in int64 on the host."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randint(0, 1 << 21, (2, ROW), generator=gen, dtype=torch.int64)
    for dtype, high in ((torch.int16, 1 << 15), (torch.uint8, 256)):
        low = -high if dtype == torch.int16 else 0
        host = [
            torch.randint(low, high, (n,), generator=gen, dtype=torch.int64).to(dtype)
            for n in (ROW + ROW // 2 + 3, 0, 5)
        ]
        words = [h.to(device) for h in host]
        got, tensor, row = _row_sums(
            fn,
            [w.data_ptr() for w in words],
            [w.numel() for w in words],
            dtype == torch.uint8,
            weights.to(device, torch.float64),
        )
        want = []
        for h in host:
            wide = h.to(torch.int64)
            for at in range(0, wide.numel(), ROW):
                part = wide[at : at + ROW]
                w = weights[:, : part.numel()]
                want.append([int(part.sum()), int((part * w[0]).sum()), int((part * w[1]).sum())])
        if got.cpu().tolist() != want or tensor.cpu().tolist() != [0, 0, 2]:
            raise RuntimeError(f"word sums of a test tensor ({dtype}) differ from the host's")
        if row.cpu().tolist() != [0, 1, 0]:
            raise RuntimeError("row indices of a test tensor differ")
