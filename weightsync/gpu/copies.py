"""Many GPU copies issued as few: coalesced where both sides lie back to back, batched, and
captured once into a CUDA graph for copy lists that repeat (a replayed bucket on the engine, a
trainer rank's write plan on the one-copy path)."""

from __future__ import annotations

import ctypes

import torch

# Plain copies at least this large go alone: a single copy runs at the copy engine's rate, which
# a fused multi-tensor kernel does not reach (measured on an H200: docs/benchmarks.md).
ONE_COPY_BYTES = 4 << 20
# Repeated copy lists run as one CUDA graph (one launch instead of one per copy).
GRAPHS = True
GRAPH_BRANCHES = 8
# A write plan's small copies go as one fused kernel launch where Triton is there
# (weightsync/gpu/kernel.py `Copies`).
FUSED = True


def issue(big: list, small: list) -> None:
    for dst, src in big:
        if src is None:  # a captured graph, or fused copies (gpu_check.Copies)
            dst.replay()
        else:
            dst.copy_(src)
    for dsts, srcs in small:
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def capture(big: list, small: list, device: torch.device) -> torch.cuda.CUDAGraph:
    """The copies, captured (not run) into a CUDA graph on a side stream, the big ones spread
    over `GRAPH_BRANCHES` parallel branches (one copy's start and end overlap another's)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    branches = [torch.cuda.Stream(device) for _ in range(GRAPH_BRANCHES)]
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            issue([], small)
            for i, branch in enumerate(branches):
                branch.wait_stream(stream)
                with torch.cuda.stream(branch):
                    issue(big[i :: len(branches)], [])
            for branch in branches:
                stream.wait_stream(branch)
        except BaseException:
            try:  # end the broken capture; the error worth reporting is the first one
                graph.capture_end()
            except RuntimeError:
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


_libcuda: list = []


def _allocation(ptr: int) -> int | None:
    """The base address of the CUDA allocation holding device address `ptr` (None: unknown)."""
    if not _libcuda:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
            fn.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _libcuda.append(fn)
    fn = _libcuda[0]
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn is None or fn(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
        return None
    return base.value


def _span(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` bytes at device address `ptr`, as uint8 (not owning them: the copy lists keep
    the tensors they belong to)."""
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def coalesce(plain: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """Plain GPU copies (destination parameter or tensor, source) of equal dtypes, in order, as (big copies [(dst, src)], small
    copies [(destinations, sources)] by dtype, one `_foreach_copy_` each): consecutive contiguous copies whose sources follow one
    another in one allocation, and whose parameters too, merged into one byte copy."""
    runs: list[list] = []  # [dst, src, dst ptr, src ptr, nbytes, dst alloc, src alloc, count]
    for param, src in plain:
        dst = param.data
        nbytes = src.numel() * src.element_size()
        if not (
            dst.is_contiguous() and src.is_contiguous() and dst.device == src.device and nbytes > 0
        ):
            runs.append([dst, src, 0, 0, nbytes, None, None, 1])
            continue
        d, s = dst.data_ptr(), src.data_ptr()
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[5] is not None
            and last[2] + last[4] == d
            and last[3] + last[4] == s
            and last[0].device == dst.device
            and _allocation(d) == last[5]
            and _allocation(s) == last[6]
        ):
            last[4] += nbytes
            last[7] += 1
            continue
        d_alloc, s_alloc = _allocation(d), _allocation(s)
        ok = d_alloc is not None and s_alloc is not None
        runs.append([dst, src, d, s, nbytes, d_alloc if ok else None, s_alloc, 1])
    big: list[tuple[torch.Tensor, torch.Tensor]] = []
    small: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src, d, s, nbytes, alloc, _, count in runs:
        if count > 1:
            dst, src = _span(d, nbytes, dst.device), _span(s, nbytes, dst.device)
        if alloc is not None and (d | s | nbytes) % 8 == 0:  # as 8-byte words: wider accesses
            dst, src = dst.reshape(-1).view(torch.int64), src.reshape(-1).view(torch.int64)
        if nbytes >= ONE_COPY_BYTES:
            big.append((dst, src))
        else:
            group = small.setdefault((dst.dtype, src.dtype), ([], []))
            group[0].append(dst)
            group[1].append(src)
    return big, list(small.values())
