"""The engine side of the one-copy path on a CPU host: parameters moved into one shared-memory
segment that trainer ranks write into (their side: weightsync/trainer/one_copy/targets.py).

Inside the engine's model process:
  1. `probe_destinations`, once, after a first sync by buckets: for each trainer tensor, load
     random bytes through the engine's own loader into the live parameter (the engine is not
     serving while it runs its loader), see which bytes changed and whether they hold the
     random bytes verbatim; then put the parameter back. The result maps a trainer tensor to
     (parameter, byte offset), or leaves it out. The tensors of one parameter (fused q/k/v, an
     MoE layer's experts) are probed together, in one load and a few passes over the
     parameter, so the cost grows with the model's bytes and tensor count, not their product.
  2. `SharedParameters`: copy those parameters into a segment (owner-only, in /dev/shm, named
     like the transport's so that a dead engine's segment is swept) and point each parameter at
     its place there (`param.data = view`). Before every update and in every check, the engine
     confirms its parameters still live there (something may have replaced them, e.g. an
     engine's own reload): otherwise the trainer falls back to buckets and shares again.
"""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from weightsync.transports.shm import PREFIX, SHM_DIR, _Segment, _unlink_all
from weightsync.wire.errors import NotShared
from weightsync.wire.specs import ALIGNMENT_BYTES, TensorSpec, align, dtype_from_str

LoadOne = Callable[[str, torch.Tensor], Any]
LoadMany = Callable[[list[tuple[str, torch.Tensor]]], Any]


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
        if torch.equal(flat[start : start + 8], raw[:8]) and torch.equal(
            flat[start : start + n], raw
        ):
            found = start
            break
    flat[lo:hi].copy_(saved[lo:hi])
    return found


def probe_destinations(
    params: dict[str, torch.Tensor],
    param_of: dict[str, list[str]],
    specs: dict[str, TensorSpec],
    load_one: LoadOne,
    load_many: LoadMany | None = None,
) -> dict[str, tuple[str, int]]:
    """{trainer tensor: (parameter name, byte offset)} for the tensors the engine's loader
    (`load_one(name, tensor)`; `load_many([(name, tensor), ...])` for several in one call)
    copies verbatim into one parameter. Each parameter probed is put back as it was, byte for
    byte, whatever happens.

    The tensors of one parameter (an MoE's experts fused into one: hundreds) are probed
    together first (`_Together`: a few passes over the parameter, not one per tensor); any it
    cannot place (a tensor under 8 bytes, one another overwrote, a loader that writes anything
    else) are probed one at a time."""
    by_param: dict[str, list[str]] = {}
    for name, targets in param_of.items():
        if len(targets) == 1 and name in specs and targets[0] in params:
            by_param.setdefault(targets[0], []).append(name)
    many = load_many or (lambda pairs: [load_one(n, t) for n, t in pairs])
    largest = max((specs[n].nbytes for names in by_param.values() for n in names), default=0)
    # Random bytes: a verbatim copy of them is found at exactly one offset.
    pool = torch.randint(
        0, 256, (largest,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    found: dict[str, tuple[str, int]] = {}
    pools = {pool.device: pool}  # the random bytes on each parameter's device
    together = _Together(specs, by_param.values())
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
                placed = together.probe(flat, saved, names, many, param.element_size())
                for name, offset in placed.items():
                    found[name] = (pname, offset)
                for name in names:
                    if name in placed:
                        continue
                    spec = specs[name]
                    raw = here[: spec.nbytes]
                    load_one(name, raw.view(dtype_from_str(spec.dtype)).view(spec.shape))
                    start = _where(flat, saved, raw)
                    if start is not None:
                        found[name] = (pname, start)
            except BaseException:
                flat.copy_(saved)
                raise
    return found


_INDEX_BITS = 24  # a key's low bits: its tensor's index among the parameter's tensors


class _Together:
    """The tensors of one parameter probed in one load. Each tensor (of at least 8 bytes) gets
    random bytes whose first 8 are its key: its index in the low bits, random above. After the
    load, every 8-byte word of the parameter at every element offset is looked up by its low
    bits (a gather, no search), words equal to a key are where tensors start, and the whole
    parameter is compared once with what those copies alone would make of it."""

    def __init__(self, specs: dict[str, TensorSpec], groups: Iterable[list[str]]) -> None:
        self.specs = specs
        self.size = max(
            (
                sum(align(specs[n].nbytes, 8) for n in group if specs[n].nbytes >= 8)
                for group in groups
            ),
            default=0,
        )
        self.pools: dict[torch.device, torch.Tensor] = {}

    def _pool(self, device: torch.device) -> torch.Tensor:
        if device not in self.pools:
            gen = torch.Generator(device=device).manual_seed(1)
            self.pools[device] = torch.randint(
                0, 256, (self.size,), dtype=torch.uint8, device=device, generator=gen
            )
        return self.pools[device]

    def probe(
        self,
        flat: torch.Tensor,
        saved: torch.Tensor,
        names: list[str],
        load_many: LoadMany,
        element_size: int,
    ) -> dict[str, int]:
        """{name: byte offset} of those of `names` the loader copied verbatim into `flat`,
        every other byte of `flat` being as in `saved` ({} otherwise: the caller probes them
        one at a time). Puts `flat` back."""
        keyed = [n for n in names if self.specs[n].nbytes >= 8]
        if len(keyed) < 2 or len(keyed) >= 1 << _INDEX_BITS:
            return {}
        sizes = [self.specs[n].nbytes for n in keyed]
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + align(size, 8))
        pool = self._pool(flat.device)
        words = torch.tensor(offsets, device=flat.device) // 8
        index = torch.arange(len(keyed), dtype=torch.int64, device=flat.device)
        high = pool.view(torch.int64)[words] & ~((1 << _INDEX_BITS) - 1)
        keys = high | index
        pool.view(torch.int64)[words] = keys  # each tensor's first 8 bytes: its key
        raws = [pool[o : o + n] for o, n in zip(offsets, sizes)]
        try:
            load_many(
                [
                    (n, raw.view(dtype_from_str(self.specs[n].dtype)).view(self.specs[n].shape))
                    for n, raw in zip(keyed, raws)
                ]
            )
            starts = self._starts(flat, keys, element_size)
            if not starts:
                return {}
            placed = [(i, s) for i, s in sorted(starts.items())]
            if any(s + sizes[i] > flat.numel() for i, s in placed):
                return {}
            expected = saved.clone()
            torch._foreach_copy_(
                [expected[s : s + sizes[i]] for i, s in placed], [raws[i] for i, _ in placed]
            )
            if not torch.equal(flat, expected):
                return {}
            return {keyed[i]: s for i, s in placed}
        finally:
            flat.copy_(saved)

    @staticmethod
    def _starts(flat: torch.Tensor, keys: torch.Tensor, element_size: int) -> dict[int, int]:
        """{tensor index: byte offset} of the words of `flat` equal to a key, at offsets that
        are multiples of 8 first, then (for keys not found there) at the other element
        offsets."""
        starts: dict[int, int] = {}
        mask = (1 << _INDEX_BITS) - 1
        for r in range(0, 8, min(element_size, 8)):
            if len(starts) == keys.numel():
                break
            count = (flat.numel() - r) // 8
            if count <= 0:
                continue
            words = flat[r : r + 8 * count]
            words = (words if words.data_ptr() % 8 == 0 else words.clone()).view(torch.int64)
            index = (words & mask).clamp_(max=keys.numel() - 1)
            at = (keys[index] == words).nonzero().view(-1)
            for word, i in zip(at.tolist(), index[at].tolist()):
                starts.setdefault(i, r + 8 * word)
        return starts


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
    return sorted(
        n
        for n, param, ptr in zip(names, current, ptrs)
        if param is None or param.data_ptr() != ptr or not param.is_contiguous()
    )


class SharedParameters:
    """Engine parameters moved into one shared-memory segment, and where each trainer tensor
    lands in it. Built in the engine's model process; see the module doc."""

    device = None  # on the CPU (CudaParameters: its GPU)

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        destinations: dict[str, tuple[str, int]],
        *,
        placements: dict[str, Any] | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
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
                view = self.segment.tensor[start : start + param.data.nbytes]
                view = view.view(param.dtype).view(param.shape)
                view.copy_(param.data)
                param.data = view
        self.label = f"shared segment {name} ({self.segment.nbytes} bytes)"
        self.tensor_offsets = {t: offsets[p] + off for t, (p, off) in destinations.items()}
        self.tensor_params = {t: p for t, (p, _) in destinations.items()}
        # A tensor-parallel worker's tensors: element size and patterns inside the parameter.
        self.placed = {
            t: [params[p].element_size(), pats] for t, (p, pats) in (placements or {}).items()
        }

    def describe(self) -> dict[str, Any]:
        """What a trainer rank needs to write here (plain data); `token` names this sharing
        (a trainer names the sharings it holds mapped when it begins a one-copy update)."""
        out = {
            "token": self.token,
            "segment": self.segment.name,
            "nbytes": self.segment.nbytes,
            "offsets": dict(self.tensor_offsets),
        }
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
            raise NotShared(
                f"{len(moved)} parameter(s) no longer live in shared segment "
                f"{self.segment.name!r}, e.g. {moved[:3]} (reloaded by the engine?); "
                f"the trainer syncs by buckets and shares them again"
            )

    def close(self) -> None:
        """Unlink the segment; the parameters keep their pages until they are freed."""
        self._finalizer()
