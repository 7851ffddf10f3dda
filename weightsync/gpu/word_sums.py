"""Modular weighted sums of many tensors' words in one pass on a GPU (the fingerprints' arithmetic).

A tensor's words x (16-bit, or bytes) are taken as rows of `ROW` words, and rows in groups of
`ROWS`. For every group this computes, reading each word once:

    s   = sum of x[r, c]
    h_m = sum over c of  w_m[c] * (sum over r of x[r, c] * v_m[r]  mod p_m)     (m = 1, 2)

with column weights w_m ([ROW]), row weights v_m ([ROWS]) and moduli p_m below 2**21: one
program takes one block of `BLOCK` columns of one group and keeps, per column, three running
sums over the group's rows in float64 registers (no reduction per row), reduces them mod p_m, and
sums them over its columns. Every product is an integer below 2**36, every running sum below
2**41 and every program's sum below 2**52 in magnitude, so float64 holds them exactly; the
programs' sums are added in int64. The same integers on any GPU, in any order.
weightsync/wire/fingerprint.py turns them into fingerprints (there the rows are otherwise
widened to float64 in scratch memory and multiplied by the weights with a GEMM: 4 bytes of
scratch written and read for every byte hashed).

Needs Triton (shipped with CUDA builds of torch); `available()` is false where it cannot compile
or run, and callers keep the GEMM.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ROW = 1 << 16  # words per row
ROWS = 32  # rows per group (row weights v_m cover a group)
BLOCK = 1024  # columns a program takes (at most 2048: a program's sums stay below 2**53)
WARPS = 8

_kernel: list = []


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def weighted_sums(
        starts,
        lengths,
        col_weights,
        row_weights,
        partial,
        p1,
        p2,
        ROW: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        BYTES: tl.constexpr,
    ):
        group = tl.program_id(0)  # on grid x: more than 65,535 groups
        block = tl.program_id(1)
        column = block * BLOCK + tl.arange(0, BLOCK)
        start = tl.load(starts + group)
        n = tl.load(lengths + group)
        if BYTES:
            words = start.to(tl.pointer_type(tl.uint8))
        else:
            words = start.to(tl.pointer_type(tl.int16))
        s = tl.zeros([BLOCK], dtype=tl.float64)
        a1 = tl.zeros([BLOCK], dtype=tl.float64)
        a2 = tl.zeros([BLOCK], dtype=tl.float64)
        rows = (n + ROW - 1) // ROW
        for r in range(0, rows):
            at = r * ROW + column
            x = tl.load(words + at, mask=at < n, other=0).to(tl.float64)
            s += x
            a1 += x * tl.load(row_weights + r)
            a2 += x * tl.load(row_weights + ROWS + r)
        q1 = p1.to(tl.float64)
        q2 = p2.to(tl.float64)
        m1 = a1 - tl.floor(a1 / q1) * q1  # exact up to one modulus either way: fixed below
        m1 = tl.where(m1 < 0, m1 + q1, m1)
        m1 = tl.where(m1 >= q1, m1 - q1, m1)
        m2 = a2 - tl.floor(a2 / q2) * q2
        m2 = tl.where(m2 < 0, m2 + q2, m2)
        m2 = tl.where(m2 >= q2, m2 - q2, m2)
        w1 = tl.load(col_weights + column)
        w2 = tl.load(col_weights + ROW + column)
        out = partial + (group * (ROW // BLOCK) + block) * 3
        tl.store(out, tl.sum(s, axis=0))
        tl.store(out + 1, tl.sum(m1 * w1, axis=0))
        tl.store(out + 2, tl.sum(m2 * w2, axis=0))

    return weighted_sums


def available() -> bool:
    """Whether Triton is importable, a GPU is visible, and the kernel has not failed to run
    (it compiles at its first launch; a failure there turns it off, see `group_sums`)."""
    if not _kernel:
        kernel = None
        if torch.cuda.is_available():
            try:
                kernel = _build()
            except ImportError:
                kernel = None
        _kernel.append(kernel)
    return _kernel[0] is not None


def disable(why: str) -> None:
    """Stop using the kernel in this process (a caller found its sums wrong)."""
    if _kernel and _kernel[0] is not None:
        logger.warning("the GPU word-sum kernel is off: %s", why)
    _kernel[:] = [None]


def group_table(
    starts: list[int], counts: list[int], *, byte_words: bool, device: torch.device
) -> torch.Tensor:
    """[4, groups] int64 on `device`: each group's first word's address, its word count, its
    run's index and the index of its first row in the run (`group_sums`'s work list, made on
    the host: kept by callers that hash the same runs again)."""
    size = 1 if byte_words else 2
    span = ROW * ROWS
    at = torch.tensor(starts, dtype=torch.int64)
    count = torch.tensor(counts, dtype=torch.int64)
    per = (count + span - 1) // span
    run = torch.repeat_interleave(torch.arange(len(starts)), per)
    first = torch.cumsum(per, 0) - per
    group = torch.arange(run.numel()) - first[run]
    return torch.stack(
        [
            at[run] + group * (span * size),
            torch.clamp(count[run] - group * span, max=span),
            run,
            group * ROWS,
        ]
    ).to(device, non_blocking=True)


def group_sums(
    starts: list[int],
    counts: list[int],
    *,
    byte_words: bool,
    col_weights: torch.Tensor,
    row_weights: torch.Tensor,
    moduli: tuple[int, int],
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For runs of words at device addresses `starts` (`counts[i]` words each; bytes if
    `byte_words`, else 16-bit words; the caller keeps their memory alive until the sums are
    read), `col_weights` ([2, ROW] float64 on their device), `row_weights` ([2, ROWS] float64)
    and `moduli` (p_1, p_2): (sums, run, first_row): `sums` [groups, 3] int64 as the module doc
    defines them (h_m not yet reduced mod p_m), `run` the index of each group's run and
    `first_row` the index of its first row in the run. `table`: `group_table` of the same
    runs, made before (`starts` and `counts` are then not read). Asynchronous: nothing is read
    back."""
    if not available():
        raise RuntimeError("the GPU word-sum kernel does not run here (see `available`)")
    device = col_weights.device
    if table is None:
        table = group_table(starts, counts, byte_words=byte_words, device=device)
    num_groups = table.shape[1]
    partial = torch.empty((num_groups, ROW // BLOCK, 3), dtype=torch.float64, device=device)
    if num_groups:
        try:
            with torch.cuda.device(device):
                _kernel[0][(num_groups, ROW // BLOCK)](
                    table[0],
                    table[1],
                    col_weights,
                    row_weights,
                    partial,
                    moduli[0],
                    moduli[1],
                    ROW=ROW,
                    ROWS=ROWS,
                    BLOCK=BLOCK,
                    BYTES=byte_words,
                    num_warps=WARPS,
                )
        except Exception as exc:  # noqa: BLE001 - cannot compile or launch: callers fall back
            disable(f"{type(exc).__name__}: {str(exc)[:300]}")
            raise RuntimeError("the GPU word-sum kernel failed to run") from exc
    return partial.to(torch.int64).sum(1), table[2], table[3]
