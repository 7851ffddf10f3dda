"""The one-copy path on one host: engine parameters in shared memory, written by the trainer.

The bucket path copies every byte twice (trainer shard -> shared bucket -> engine parameter). On
a CPU host the second copy is avoidable: the engine moves its parameters into one shared-memory
segment, and each trainer rank writes its own shards straight into them. It works for the
tensors the engine's loader copies verbatim into one contiguous byte range of one parameter
(most of them: fused QKV and gate/up parameters are concatenations along dim 0); any other tensor
keeps the engine on the bucket path.

Engine side: weightsync/engine/one_copy/segment.py (the probe, the shared segment).
Trainer side: `OneCopyTarget` maps the segment by name and writes byte ranges into it.

Only plain data crosses: the segment's name and size, and {tensor name: byte offset}.

Verification, when asked for, checks the two links of the chain separately. (1) The bytes: each
rank's write plan copies its pieces in batches of about 1 MiB and compares each batch byte for
byte with what reads back from the engine's parameters through its mapping of the segment,
while both are still in cache (`CheckedCopiesCPU`); a piece written outside a plan is copied
in chunks of `CHECK_CHUNK_BYTES`, each chunk's sum of 64-bit words compared with the same sum
read back (`copy_checked`). (2) The parameters: at every `end` of a one-copy
update, verified or not, the engine confirms in its own process that every shared parameter
still is those bytes (its storage starts where the segment says) or fails the update, so the
engine computes with what was written and checked.
Where each tensor goes inside a parameter was established by the probe, from the engine's own
loader. The engine's independent per-parameter fingerprints (`fingerprints()`, as on the bucket
path) stay available for a deeper check at any time.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.transports.shm import PREFIX, SHM_DIR, _Segment

# Small enough that a chunk's source and destination stay in a core's L2 cache between the copy
# and the read-back.
CHECK_CHUNK_BYTES = 128 << 10


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy 1-D uint8 `src` into `dst` chunk by chunk, comparing each chunk's wrapping sum of
    64-bit words in `src` and, read back, in `dst` while both are in cache. True if all match.

    numpy, not torch: per chunk a torch call costs ~30 us, numpy's ~1 us."""
    import numpy as np

    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    s, d = src.numpy(), dst.numpy()
    body = s.size - s.size % 8
    intact = True
    if body:
        s64, d64 = s[:body].view(np.uint64), d[:body].view(np.uint64)
        step = CHECK_CHUNK_BYTES // 8
        for i in range(0, s64.size, step):
            a, b = s64[i : i + step], d64[i : i + step]
            np.copyto(b, a)
            if np.add.reduce(a) != np.add.reduce(b):
                intact = False
    if body < s.size:
        d[body:] = s[body:]
        intact = intact and bytes(d[body:]) == bytes(s[body:])
    return intact


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat uint8 tensors of one length hold the same bytes: compared as 64-bit
    words where they can be (~7x faster than byte by byte), the rest byte by byte."""
    head = a.numel() - a.numel() % 8
    if head and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        if not torch.equal(a[:head].view(torch.int64), b[:head].view(torch.int64)):
            return False
        return head == a.numel() or torch.equal(a[head:], b[head:])
    return torch.equal(a, b)


class CheckedCopiesCPU:
    """A write plan's copies into CPU shared memory, each batch of about `BATCH_BYTES` read back
    and compared byte for byte with its sources right after it is copied, while both are in
    cache: one `_foreach_copy_`, two `cat`s into kept scratch and one `equal` a batch, none a
    tensor (a verified one-copy sync of many small tensors otherwise pays ~40 us each in
    `copy_checked`'s calls). A pair that cannot be batched (a strided view, a dtype changed on
    the way) is copied and compared alone. The same `launch` / `differing` as the GPU's
    `kernel.CheckedCopies`; on the CPU `launch` returns when every copy is done and checked."""

    BATCH_BYTES = 1 << 20

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # Per batch: destinations, sources, their flat byte views, the pairs' indices, bytes.
        self.batches: list[tuple[list, list, list, list, list[int], int]] = []
        self.alone: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        index: list[int] = []
        nbytes = size = 0
        for i, (dst, src) in enumerate(pairs):
            if dst.dtype != src.dtype or not (dst.is_contiguous() and src.is_contiguous()):
                self.alone.append((i, dst, src))
                continue
            n = dst.numel() * dst.element_size()
            if dsts and nbytes + n > self.BATCH_BYTES:
                self._add(dsts, srcs, index, nbytes)
                size = max(size, nbytes)
                dsts, srcs, index, nbytes = [], [], [], 0
            dsts.append(dst)
            srcs.append(src)
            index.append(i)
            nbytes += n
        if dsts:
            self._add(dsts, srcs, index, nbytes)
            size = max(size, nbytes)
        self.scratch = (torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8))
        self._differing: list[int] = []

    def _add(self, dsts: list, srcs: list, index: list[int], nbytes: int) -> None:
        flat = [t.reshape(-1).view(torch.uint8) for t in dsts]
        self.batches.append(
            (dsts, srcs, flat, [t.reshape(-1).view(torch.uint8) for t in srcs], index, nbytes)
        )

    def launch(self) -> None:
        bad = []
        mine, theirs = self.scratch
        for dsts, srcs, dflat, sflat, index, nbytes in self.batches:
            torch._foreach_copy_(dsts, srcs)
            if len(dflat) == 1:
                same = _same_bytes(dflat[0], sflat[0])
            else:
                torch.cat(dflat, out=mine[:nbytes])
                torch.cat(sflat, out=theirs[:nbytes])
                same = _same_bytes(mine[:nbytes], theirs[:nbytes])
            if not same:  # which ones: rare, so one at a time
                bad += [i for i, d, s in zip(index, dflat, sflat) if not _same_bytes(d, s)]
        for i, dst, src in self.alone:
            dst.copy_(src)
            if not torch.equal(dst, src.to(dst.dtype)):
                bad.append(i)
        self._differing = sorted(bad)

    def differing(self) -> list[int]:
        """Indices (into the pairs given) of the copies that read back differently."""
        return self._differing


class OneCopyTarget:
    """One engine's (one worker's) parameters, mapped into a trainer rank: a shared-memory
    segment (CPU), or the CUDA storages of its parameters opened by IPC handle (GPU,
    weightsync/engine/one_copy/cuda_exports.py). Either way a list of flat byte tensors and, per trainer tensor,
    which of them and the byte offset where it starts."""

    def __init__(self, shared: dict[str, Any], *, shm_dir: str = SHM_DIR) -> None:
        self.segment: _Segment | None = None
        self.placed: dict[str, Any] = shared.get("placed") or {}
        self.written = 0  # bytes written into the parameters, since made
        if "cuda" in shared:
            from weightsync.transports.cuda_ipc import open_storage

            self.name = f"CUDA storages of {shared['cuda']['owner']}"
            self.memory = [open_storage(e) for e in shared["cuda"]["storages"]]
            self.where = {k: (int(i), int(o)) for k, (i, o) in shared["offsets"].items()}
            self.device: torch.device | None = self.memory[0].device if self.memory else None
            return
        name = shared["segment"]
        if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shared parameters name segment {name!r}; expected '{PREFIX}...'")
        self.name = name
        self.segment = _Segment(name, int(shared["nbytes"]), create=False, shm_dir=shm_dir)
        self.memory = [self.segment.tensor]
        self.where = {k: (0, int(v)) for k, v in shared["offsets"].items()}
        self.device = None

    def flush(self) -> None:
        """Wait until every write issued here has landed (GPU copies are asynchronous)."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def write(self, name: str, offset: int, src: torch.Tensor, *, check: bool = False) -> bool:
        """Copy `src`'s bytes to byte `offset` of tensor `name`'s place; with `check`, read
        them back (`copy_checked`) and return whether they arrived intact. A placed tensor
        (a tensor-parallel worker's) gets only the elements the worker holds, where it holds
        them."""
        raw = (
            src
            if src.dtype == torch.uint8 and src.dim() == 1
            else src.reshape(-1).view(torch.uint8)
        )
        if name in self.placed:
            return self._write_placed(name, offset, raw, check=check)
        index, base = self.where[name]
        start = base + offset
        dst = self.memory[index][start : start + raw.numel()]
        self.written += raw.numel()
        if check:
            if dst.device.type == "cpu":
                return copy_checked(dst, raw)
            dst.copy_(raw)
            return torch.equal(dst, raw.to(dst.device))
        dst.copy_(raw)
        return True

    def _write_placed(self, name: str, offset: int, raw: torch.Tensor, *, check: bool) -> bool:
        intact = True
        for d_view, s_view in self._placed_views(name, offset, raw):
            d_view.copy_(s_view)
            self.written += d_view.numel() * d_view.element_size()
            if check:
                intact = intact and torch.equal(d_view, s_view)
        return intact

    def _placed_views(
        self, name: str, offset: int, raw: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size, pats = self.placed[name]
        if offset % size or raw.numel() % size:
            raise ValueError(
                f"{name!r}: a piece at byte {offset} of {raw.numel()} bytes is not "
                f"whole {size}-byte elements"
            )
        word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        index, base = self.where[name]
        dst = self.memory[index][base:].view(word)  # the parameter from here on
        return placed_pieces(dst, raw.view(word), offset // size, pats)

    def copies(
        self,
        name: str,
        offset: int,
        src: torch.Tensor,
        dtype: torch.dtype,
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(destination, source) view pairs whose copies write `src`, converted to `dtype`, as
        `write` would: kept by a write plan and copied again every sync. None where that
        needs a converted copy of `src` per sync (a placed tensor changing dtype)."""
        if name in self.placed:
            if src.dtype != dtype or not src.is_contiguous():
                return None
            return self._placed_views(name, offset, src.reshape(-1).view(torch.uint8))
        index, base = self.where[name]
        start = base + offset
        if start % dtype.itemsize:
            return None
        dst = self.memory[index][start : start + src.numel() * dtype.itemsize]
        return [(dst.view(dtype).view(src.shape), src)]

    def close(self) -> None:
        self.memory = []
        if self.segment is not None:
            self.segment.close()


def placed_pieces(
    dst: torch.Tensor, src: torch.Tensor, start: int, pats: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) pairs that put `src`, elements [start, start + n) of a
    flat tensor, where the patterns (weightsync/wire/placement.py) say, into the flat `dst`."""
    end = start + src.numel()
    out = []
    for d, s, length, count, d_stride, s_stride in pats:
        if count == 1:
            d_stride = s_stride = length
        # Whole runs inside [start, end): one strided view on each side.
        first = max(0, -(-(start - s) // s_stride))
        last = min(count, (end - s - length) // s_stride + 1) if end - s >= length else 0
        if last > first:
            out.append(
                (
                    dst.as_strided(
                        (last - first, length),
                        (d_stride, 1),
                        dst.storage_offset() + d + first * d_stride,
                    ),
                    src.as_strided(
                        (last - first, length),
                        (s_stride, 1),
                        src.storage_offset() + s + first * s_stride - start,
                    ),
                )
            )
        # Runs cut by either end of the piece.
        for i in {first - 1, max(last, first)}:
            if not 0 <= i < count:
                continue
            lo = max(start, s + i * s_stride)
            hi = min(end, s + i * s_stride + length)
            if hi > lo and not (first <= i < last):
                at = d + i * d_stride + lo - (s + i * s_stride)
                out.append((dst[at : at + hi - lo], src[lo - start : hi - start]))
    return out
