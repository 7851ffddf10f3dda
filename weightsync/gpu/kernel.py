"""Verified GPU copies in one pass: each word is read back right after it is written.

A verified one-copy sync on the CPU reads every chunk back while it is in cache
(`targets.copy_checked`). On a GPU the same idea is one Triton kernel for all of a write plan's
copies on a device: a program copies one chunk of one copy (at most `CHUNK` bytes) as 8-byte
words, reads every word back from the destination with a volatile load (from the GPU's memory
system, not from registers) right after storing it, and adds how many words differ to that
copy's counter. The read-back should meet the L2 the store just filled, where a separate
comparison pass would read both sides from memory again (measured on an H200 over the 24-layer
Qwen3-30B-A3B layout's 9435 tensors: the kernel with the read-back takes about as long as
without, 1.06-1.08x a device copy of the same bytes; a verified one-copy sync -7% to +13%
against an unverified one, docs/benchmarks.md). The counters are read by the host once per
sync, after the caller has checked its plan (`launch`, then `differing`).

Copies it cannot take (a dtype conversion, a side that is not contiguous or not 8-byte aligned)
are copied with `copy_` and compared with `torch.equal`, one at a time. Needs Triton (shipped
with CUDA builds of torch) and its toolchain; where the kernel cannot compile or run,
`available()` is false and callers copy through CUDA graphs and verify piece by piece.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Measured on an H200 (scripts/gpu_check_bench.py, docs/benchmarks.md): 256 KB programs of
# 16 warps stepping 4096 words ran the checked copies of both real layouts 2-3% faster than
# 1 MB programs of 4 warps stepping 1024 words.
CHUNK = 1 << 18  # bytes a program copies and checks
BLOCK = 4096  # 8-byte words per step of a program
WARPS = 16  # warps a program runs on

_kernel: list = []
_loaded: set[torch.device] = set()  # devices the kernel ran on


def available() -> bool:
    """Whether the fused kernel runs here: Triton importable, and (where a GPU is visible) the
    kernel compiled and ran one small copy with and without the read-back. Checked once a
    process: compiling needs Triton's toolchain (a C compiler for its launcher, ptxas), and a
    kernel that cannot compile must leave callers their fallbacks (copies captured in a CUDA
    graph, verification piece by piece) instead of failing a sync at its first replay."""
    if not _kernel:
        try:
            kernel = _build()
        except ImportError:
            kernel = None
        if kernel is not None and torch.cuda.is_available():
            try:
                _try(kernel, torch.device("cuda", torch.cuda.current_device()))
            except Exception as exc:  # noqa: BLE001 - any failure to compile or run: fall back
                logger.warning(
                    "the fused GPU copy kernel does not run here (%s: %s); GPU copies "
                    "go as CUDA graphs and are verified piece by piece",
                    type(exc).__name__,
                    str(exc)[:300],
                )
                kernel = None
        _kernel.append(kernel)
    return _kernel[0] is not None


def _try(kernel, device: torch.device) -> None:
    """Compile `kernel` for both CHECK values and run each on 64 bytes on `device` (loading
    it there before a sync's first launch): the copy must land and the read-back find no
    difference."""
    with torch.cuda.device(device):
        src = torch.arange(8, dtype=torch.int64, device=device)
        dst = torch.zeros_like(src)
        tables = [
            torch.tensor([t], dtype=torch.int64, device=device)
            for t in (dst.data_ptr(), src.data_ptr(), 8, 0)
        ]
        wrong = torch.zeros(1, dtype=torch.int32, device=device)
        for check in (False, True):
            dst.zero_()
            kernel[(1,)](*tables, wrong, BLOCK=BLOCK, CHECK=check, num_warps=WARPS)
            if not torch.equal(dst, src) or int(wrong.item()):
                raise RuntimeError(f"a 64-byte test copy (CHECK={check}) did not land")
    _loaded.add(device)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_check(dsts, srcs, words, copy_of, wrong, BLOCK: tl.constexpr, CHECK: tl.constexpr):
        row = tl.program_id(0)
        dst = tl.load(dsts + row).to(tl.pointer_type(tl.int64))
        src = tl.load(srcs + row).to(tl.pointer_type(tl.int64))
        n = tl.load(words + row)
        lane = tl.arange(0, BLOCK)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            at = start + lane
            inside = at < n
            x = tl.load(src + at, mask=inside)
            tl.store(dst + at, x, mask=inside)
            if CHECK:
                back = tl.load(dst + at, mask=inside, volatile=True)
                bad += (back != x).to(tl.int32)
        if CHECK:
            tl.atomic_add(wrong + tl.load(copy_of + row), tl.sum(bad, axis=0))

    return copy_check


def fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the kernel can take this copy (same dtype, both contiguous and 8-byte aligned,
    one device)."""
    nbytes = src.numel() * src.element_size()
    return (
        dst.dtype == src.dtype
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.device == src.device
        and (dst.data_ptr() | src.data_ptr() | nbytes) % 8 == 0
    )


class CheckedCopies:
    """A fixed list of (destination, source) copies on one GPU, run as verified copies: `run()`
    copies them all and returns the indices of those whose destination did not read back as the
    source. Keeps the tensors (their addresses are in its tables) alive."""

    def __init__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> None:
        if not available():
            raise RuntimeError(
                "the fused GPU copy kernel does not run here (Triton missing or "
                "its trial copy failed; see the log)"
            )
        if device not in _loaded:
            _try(_kernel[0], device)
        self.pairs = pairs
        self.device = device
        self.others = [i for i, (d, s) in enumerate(pairs) if not fusable(d, s)]
        dsts, srcs, words, copy_of = [], [], [], []
        for i, (dst, src) in enumerate(pairs):
            if not fusable(dst, src):
                continue
            d, s, nbytes = dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()
            for at in range(0, nbytes, CHUNK):
                dsts.append(d + at)
                srcs.append(s + at)
                words.append(min(CHUNK, nbytes - at) // 8)
                copy_of.append(i)
        self.rows = len(dsts)
        self.tables = [
            torch.tensor(t, dtype=torch.int64, device=device) for t in (dsts, srcs, words, copy_of)
        ]
        self.wrong = torch.zeros(len(pairs), dtype=torch.int32, device=device)

    def run(self) -> list[int]:
        self.launch()
        return self.differing()

    def launch(self) -> None:
        """Issue the fused copies on the current stream (asynchronous)."""
        with torch.cuda.device(self.device):
            self.wrong.zero_()
            if self.rows:
                _kernel[0][(self.rows,)](
                    *self.tables, self.wrong, BLOCK=BLOCK, CHECK=True, num_warps=WARPS
                )

    def differing(self) -> list[int]:
        """After `launch`: copy and compare the pairs the kernel cannot take, wait for the
        kernel, and return the indices of the pairs whose destination differs."""
        with torch.cuda.device(self.device):
            differ = [i for i in self.others if not _copy_equal(*self.pairs[i])]
            return sorted(differ + self.wrong.nonzero().flatten().tolist())


def _copy_equal(dst: torch.Tensor, src: torch.Tensor) -> bool:
    dst.copy_(src)
    return torch.equal(dst, src.to(dst.device, dst.dtype))


class Copies(CheckedCopies):
    """The same kernel without the read-back: copies a fixed list of many small (fusable) copies
    in one launch. Against the same copies as torch's multi-tensor `_foreach_copy_` kernels
    captured in a CUDA graph it saved ~3.5 ms a sync over 18867 expert tensors of ~3 MB on an
    H200 (docs/benchmarks.md; why, not profiled). `replay()` issues them on the current stream,
    as a captured graph's does. Like the graph, it holds the addresses of the tensors it was
    given: they must not be freed in place (`untyped_storage().resize_(0)`) while it lives."""

    def __init__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> None:
        super().__init__(pairs, device)
        if self.others:
            raise ValueError(
                f"{len(self.others)} copies the fused kernel cannot take (see `fusable`)"
            )

    def replay(self) -> None:
        if self.rows:
            with torch.cuda.device(self.device):
                _kernel[0][(self.rows,)](
                    *self.tables, self.wrong, BLOCK=BLOCK, CHECK=False, num_warps=WARPS
                )
