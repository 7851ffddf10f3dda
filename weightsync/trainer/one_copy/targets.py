"""The one-copy path on one host: engine parameters in shared memory, written by the trainer.

The bucket path copies every byte twice (trainer shard -> shared bucket -> engine parameter). On
a CPU host the second copy is avoidable: the engine moves its parameters into one shared-memory
segment, and each trainer rank writes its own shards straight into them. It works for the
tensors the engine's loader copies verbatim into one contiguous byte range of one parameter
(most of them: fused QKV and gate/up parameters are concatenations along dim 0); any other tensor
keeps the engine on the bucket path.

Engine side (inside the engine's model process):
  1. `probe_destinations`, once, after a first sync by buckets: for each trainer tensor, load
     random bytes through the engine's own loader into the live parameter (the engine is not
     serving while it runs its loader), see which bytes changed and whether they hold the
     random bytes verbatim; then put the parameter back. The result maps a trainer tensor to
     (parameter, byte offset), or leaves it out.
  2. `SharedParameters`: copy those parameters into a segment (owner-only, in /dev/shm, named
     like the transport's so that a dead engine's segment is swept) and point each parameter at
     its place there (`param.data = view`). Before every update and in every check, the engine
     confirms its parameters still live there (something may have replaced them, e.g. an
     engine's own reload): otherwise the trainer falls back to buckets and shares again.
Trainer side: `DirectTarget` maps the segment by name and writes byte ranges into it.

Only plain data crosses: the segment's name and size, and {tensor name: byte offset}.

Verification, when asked for, checks the two links of the chain separately. (1) The bytes: each
rank copies its pieces in chunks of `CHECK_CHUNK_BYTES` and compares each chunk's sum of 64-bit
words with the same sum read back from the engine's parameters through its mapping of the
segment, while both are still in the core's cache (`copy_checked`: the read-back costs ~a third
of the copy instead of two more passes over memory). (2) The parameters: at every `end` of a one-copy
update, verified or not, the engine confirms in its own process that every shared parameter
still is those bytes (its storage starts where the segment says) or fails the update, so the
engine computes with what was written and checked.
Where each tensor goes inside a parameter was established by the probe, from the engine's own
loader. The engine's independent per-parameter fingerprints (`fingerprints()`, as on the bucket
path) stay available for a deeper check at any time.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from weightsync.wire.errors import NotShared
from weightsync.transports.shm import PREFIX, SHM_DIR, _Segment, _unlink_all
from weightsync.wire.specs import ALIGNMENT_BYTES, TensorSpec, align, dtype_from_str

logger = logging.getLogger(__name__)

LoadOne = Callable[[str, torch.Tensor], Any]

# Small enough that a chunk's source and destination stay in a core's L2 cache between the copy
# and the read-back.
CHECK_CHUNK_BYTES = 128 << 10


# ---- engine side ---------------------------------------------------------------------------------
def _where(flat: torch.Tensor, saved: torch.Tensor, raw: torch.Tensor) -> int | None:
    """Byte offset in `flat` at which the bytes `raw` sit verbatim, every other byte of `flat`
    being as in `saved`; None if the loader wrote anything else. Puts `flat` back."""
    word = 8 if flat.numel() % 8 == 0 else 1
    view = torch.int64 if word == 8 else torch.uint8
    changed = (flat.view(view) != saved.view(view)).view(torch.uint8)
    if not bool(changed.any()):
        return None
    lo = int(changed.argmax()) * word  # the first and last changed words, in bytes
    hi = (changed.numel() - int(changed.flip(0).argmax())) * word
    n = raw.numel()
    # The copy's first and last bytes may equal the old ones by chance: the start lies in
    # [hi - n - word, lo + word].
    found = None
    for start in range(max(0, hi - n - word), min(lo + word, flat.numel() - n) + 1):
        if torch.equal(flat[start:start + 8], raw[:8]) and torch.equal(
                flat[start:start + n], raw):
            found = start
            break
    flat[lo:hi].copy_(saved[lo:hi])
    return found


def probe_destinations(params: dict[str, torch.Tensor], param_of: dict[str, list[str]],
                       specs: dict[str, TensorSpec], load_one: LoadOne,
                       ) -> dict[str, tuple[str, int]]:
    """{trainer tensor: (parameter name, byte offset)} for the tensors the engine's loader
    (`load_one(name, tensor)`) copies verbatim into one parameter. Each parameter probed is put
    back as it was, byte for byte, whatever happens."""
    by_param: dict[str, list[str]] = {}
    for name, targets in param_of.items():
        if len(targets) == 1 and name in specs and targets[0] in params:
            by_param.setdefault(targets[0], []).append(name)
    largest = max((specs[n].nbytes for names in by_param.values() for n in names), default=0)
    # Random bytes: a verbatim copy of them is found at exactly one offset.
    pool = torch.randint(0, 256, (largest,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    found: dict[str, tuple[str, int]] = {}
    pools = {pool.device: pool}  # the random bytes on each parameter's device
    with torch.no_grad():
        for pname, names in by_param.items():
            param = params[pname]
            if param.device.type not in ("cpu", "cuda") or not param.data.is_contiguous():
                continue
            flat = param.data.reshape(-1).view(torch.uint8)
            saved = flat.clone()
            if param.device not in pools:
                pools[param.device] = pool.to(param.device)
            here = pools[param.device]
            try:
                for name in names:
                    spec = specs[name]
                    raw = here[:spec.nbytes]
                    load_one(name, raw.view(dtype_from_str(spec.dtype)).view(spec.shape))
                    start = _where(flat, saved, raw)
                    if start is not None:
                        found[name] = (pname, start)
            except BaseException:
                flat.copy_(saved)
                raise
    return found


_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous


def moved_from(names: Iterable[str], current: list[Any], ptrs: list[int]) -> list[str]:
    """Of the parameters `names`, those whose registered tensor (`current`, in the same order;
    None: unregistered) no longer starts at its address in `ptrs` or is not contiguous. Checked
    in bulk first (the loops in C): thousands of parameters in an MoE, twice a sync. The
    parameter's own data_ptr, not `.data`'s: the same storage, without a tensor per parameter."""
    try:
        if list(map(_data_ptr, current)) == ptrs and all(map(_contiguous, current)):
            return []
    except TypeError:  # one is no longer registered
        pass
    return sorted(n for n, param, ptr in zip(names, current, ptrs)
                  if param is None or param.data_ptr() != ptr or not param.is_contiguous())


class SharedParameters:
    """Engine parameters moved into one shared-memory segment, and where each trainer tensor
    lands in it. Built in the engine's model process; see the module doc."""

    device = None  # on the CPU (CudaParameters: its GPU)

    def __init__(self, params: dict[str, torch.Tensor],
                 destinations: dict[str, tuple[str, int]], *,
                 placements: dict[str, Any] | None = None, shm_dir: str = SHM_DIR) -> None:
        names = sorted({pname for pname, _ in destinations.values()})
        offsets: dict[str, int] = {}
        total = 0
        for pname in names:
            offsets[pname] = total
            total += align(params[pname].data.nbytes)
        name = f"{PREFIX}{os.getpid()}-params-{secrets.token_hex(4)}"
        self.segment = _Segment(name, max(total, ALIGNMENT_BYTES), create=True, shm_dir=shm_dir)
        self._finalizer = weakref.finalize(self, _unlink_all, shm_dir, [name])
        self.token = name  # names this sharing: a trainer's writes say which one they are for
        self.params = {pname: params[pname] for pname in names}
        base = self.segment.tensor.data_ptr()
        self._ptrs = [base + offsets[pname] for pname in names]  # where each one lives
        with torch.no_grad():
            for pname in names:
                param = params[pname]
                start = offsets[pname]
                view = self.segment.tensor[start:start + param.data.nbytes]
                view = view.view(param.dtype).view(param.shape)
                view.copy_(param.data)
                param.data = view
        self.label = f"shared segment {name} ({self.segment.nbytes} bytes)"
        self.tensor_offsets = {t: offsets[p] + off for t, (p, off) in destinations.items()}
        self.tensor_params = {t: p for t, (p, _) in destinations.items()}
        # A tensor-parallel worker's tensors: element size and patterns inside the parameter.
        self.placed = {t: [params[p].element_size(), pats]
                       for t, (p, pats) in (placements or {}).items()}

    def describe(self) -> dict[str, Any]:
        """What a trainer rank needs to write here (plain data); `token` names this sharing
        (a trainer names the sharings it holds mapped when it begins a one-copy update)."""
        out = {"token": self.token, "segment": self.segment.name,
               "nbytes": self.segment.nbytes, "offsets": dict(self.tensor_offsets)}
        if self.placed:
            out["placed"] = self.placed
        return out

    def moved(self, current: list[Any] | None = None) -> list[str]:
        """Parameters whose storage is no longer their place in the segment. `current`: what
        is registered in each one's place now, in `params` order (None: unregistered);
        default the parameters as shared."""
        params = list(self.params.values()) if current is None else current
        return moved_from(self.params, params, self._ptrs)

    def check(self, current: list[Any] | None = None) -> None:
        """Raise `NotShared` unless every parameter still lives at its place in the segment
        (see `moved`)."""
        moved = self.moved(current)
        if moved:
            raise NotShared(f"{len(moved)} parameter(s) no longer live in shared segment "
                            f"{self.segment.name!r}, e.g. {moved[:3]} (reloaded by the engine?); "
                            f"the trainer syncs by buckets and shares them again")

    def close(self) -> None:
        """Unlink the segment; the parameters keep their pages until they are freed."""
        self._finalizer()


# ---- trainer side ---------------------------------------------------------------------------------
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
            a, b = s64[i:i + step], d64[i:i + step]
            np.copyto(b, a)
            if np.add.reduce(a) != np.add.reduce(b):
                intact = False
    if body < s.size:
        d[body:] = s[body:]
        intact = intact and bytes(d[body:]) == bytes(s[body:])
    return intact


class DirectTarget:
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
        raw = src if src.dtype == torch.uint8 and src.dim() == 1 else \
            src.reshape(-1).view(torch.uint8)
        if name in self.placed:
            return self._write_placed(name, offset, raw, check=check)
        index, base = self.where[name]
        start = base + offset
        dst = self.memory[index][start:start + raw.numel()]
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

    def _placed_views(self, name: str, offset: int, raw: torch.Tensor
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size, pats = self.placed[name]
        if offset % size or raw.numel() % size:
            raise ValueError(f"{name!r}: a piece at byte {offset} of {raw.numel()} bytes is not "
                             f"whole {size}-byte elements")
        word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        index, base = self.where[name]
        dst = self.memory[index][base:].view(word)  # the parameter from here on
        return placed_pieces(dst, raw.view(word), offset // size, pats)

    def copies(self, name: str, offset: int, src: torch.Tensor, dtype: torch.dtype,
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
        dst = self.memory[index][start:start + src.numel() * dtype.itemsize]
        return [(dst.view(dtype).view(src.shape), src)]

    def close(self) -> None:
        self.memory = []
        if self.segment is not None:
            self.segment.close()


def placed_pieces(dst: torch.Tensor, src: torch.Tensor, start: int,
                  pats: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
            out.append((dst.as_strided((last - first, length), (d_stride, 1),
                                       dst.storage_offset() + d + first * d_stride),
                        src.as_strided((last - first, length), (s_stride, 1),
                                       src.storage_offset() + s + first * s_stride - start)))
        # Runs cut by either end of the piece.
        for i in {first - 1, max(last, first)}:
            if not 0 <= i < count:
                continue
            lo = max(start, s + i * s_stride)
            hi = min(end, s + i * s_stride + length)
            if hi > lo and not (first <= i < last):
                at = d + i * d_stride + lo - (s + i * s_stride)
                out.append((dst[at:at + hi - lo], src[lo - start:hi - start]))
    return out
