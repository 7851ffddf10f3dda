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
from collections.abc import Callable, Iterable, Mapping
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

    Parameters are probed many at a time (`_Groups`: the tensors of up to `GROUP_BYTES` of
    parameters, or of one larger parameter, in one load, then a few passes over those bytes,
    no step per tensor); those a group cannot place (tensors not back to back in the order
    given, one another overwrote, a loader that writes anything else) are probed one
    parameter at a time (`_Together`: it finds tensors wherever they landed), and what that
    leaves, one tensor at a time."""
    by_param: dict[str, list[str]] = {}
    for name, targets in param_of.items():
        if len(targets) == 1 and name in specs and targets[0] in params:
            by_param.setdefault(targets[0], []).append(name)
    many = load_many or (lambda pairs: [load_one(n, t) for n, t in pairs])
    found: dict[str, tuple[str, int]] = {}
    with torch.no_grad():
        probed = {
            p: names
            for p, names in by_param.items()
            if params[p].device.type in ("cpu", "cuda") and params[p].data.is_contiguous()
        }
        rest = _Groups(params, specs).probe(probed, many, found)
        if rest:
            _one_by_one(params, specs, rest, load_one, many, found)
    return found


def _one_by_one(
    params: dict[str, torch.Tensor],
    specs: dict[str, TensorSpec],
    by_param: dict[str, list[str]],
    load_one: LoadOne,
    many: LoadMany,
    found: dict[str, tuple[str, int]],
) -> None:
    """Into `found`: the tensors of `by_param` placed by probing one parameter at a time (its
    tensors together first, then those left one at a time)."""
    largest = max((specs[n].nbytes for names in by_param.values() for n in names), default=0)
    # Random bytes: a verbatim copy of them is found at exactly one offset.
    pool = torch.randint(
        0, 256, (largest,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    pools = {pool.device: pool}  # the random bytes on each parameter's device
    together = _Together(specs, by_param.values())
    for pname, names in by_param.items():
        param = params[pname]
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


class WholePlacements:
    """Where a loader copies tensors whole and verbatim into their parameters, learned without
    touching the live weights: `place(param, names, load_many)` -> {tensor: element offset}.
    One load of all of a parameter's tensors (`_Together`: keyed random bytes, a few passes
    over the parameter) on a zeroed scratch copy swapped in as `param.data`. A tensor-parallel
    worker's slices, and tensors of another dtype, are not placed whole: the caller learns
    those element by element (weightsync/wire/placement.py)."""

    def __init__(self, specs: dict[str, TensorSpec], groups: Iterable[list[str]]) -> None:
        """`groups`: the names of each parameter to be placed (the random bytes are made once,
        for the largest)."""
        self.specs = specs
        self.together = _Together(specs, groups)

    def place(self, param: torch.Tensor, names: list[str], load_many: LoadMany) -> dict[str, int]:
        live = param.data
        if param.device.type not in ("cpu", "cuda") or not live.is_contiguous():
            return {}
        mine = [n for n in names if _dtype(self.specs[n].dtype) == param.dtype]
        if not mine:
            return {}
        scratch = torch.zeros_like(live)
        size = param.element_size()
        try:
            param.data = scratch
            with torch.no_grad():
                flat = scratch.reshape(-1).view(torch.uint8)
                found = self.together.probe(flat, None, mine, load_many, size, fewest=1)
        finally:
            param.data = live
        return {n: at // size for n, at in found.items() if at % size == 0}

    def place_all(
        self,
        params: Mapping[str, torch.Tensor],
        by_param: dict[str, list[str]],
        load_many: LoadMany,
        first: dict[str, int] | None = None,
        pools: dict[torch.device, torch.Tensor] | None = None,
    ) -> dict[str, tuple[str, int]]:
        """{tensor: (parameter, element offset)} of `by_param`'s tensors placed whole. First a
        guess for many parameters at once (`_Groups` on zeroed scratch: each parameter's
        tensors back to back from its byte `first[parameter]`, or 0, in the order given; one
        load a group and one comparison confirm it); the parameters it misses, one at a time
        (`place`). `pools`: as `_Groups` keeps them."""
        guessed = {
            pname: names
            for pname, names in by_param.items()
            if names
            and params[pname].device.type in ("cpu", "cuda")
            and params[pname].data.is_contiguous()
            and all(_dtype(self.specs[n].dtype) == params[pname].dtype for n in names)
        }
        found: dict[str, tuple[str, int]] = {}
        with torch.no_grad():
            rest = _Groups(params, self.specs, scratch=True, first=first, pools=pools).probe(
                guessed, load_many, found
            )
        out = {n: (p, at // params[p].element_size()) for n, (p, at) in found.items()}
        for pname, names in by_param.items():
            if pname in guessed and pname not in rest:
                continue
            whole = self.place(params[pname], names, load_many)
            out.update({n: (pname, at) for n, at in whole.items()})
        return out


GROUP_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}  # parameter bytes probed in one load


class _Groups:
    """Parameters probed many at a time, on the guess that the loader copies each parameter's
    tensors verbatim and back to back from its first byte, in the order given (one tensor per
    parameter; q, k, v of a fused one; an MoE layer's experts). The parameters of a group (at
    most `GROUP_BYTES`, or one larger parameter, on one device) are laid back to back (8-byte aligned) in a buffer, and
    each tensor gets the random bytes of a pool at the place the guess gives it there; the
    group's tensors are loaded in one call. The parameters are copied into one buffer before
    the load and into another after it (then put back); the first with the pool's bytes laid
    over every guessed place must equal the second. A parameter where any byte differs is
    left to the one-parameter probe (`_Together`: it finds tensors wherever they landed), so
    the common case costs a few passes over the bytes and one view and one loader call per
    tensor, with no step per tensor in between."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        specs: dict[str, TensorSpec],
        *,
        scratch: bool = False,
        first: dict[str, int] | None = None,
        pools: dict[torch.device, torch.Tensor] | None = None,
    ) -> None:
        """`scratch`: the loads go into zeroed scratch memory swapped in as each parameter's
        `.data` (the live weights are neither read nor written: learning while an engine
        serves them); `first`: per parameter, the byte where the guess starts (0 if absent;
        the tensors an earlier bucket placed there end before it); `pools`: CPU random bytes
        kept by the caller from one call to the next (a bucket's learning to the next's)."""
        self.params = params
        self.specs = specs
        self.scratch = scratch
        self.first = first or {}
        self.pools = pools
        # per device: (before: None with `scratch`, after, the pool of random bytes)
        self.buffers: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]
        self.buffers = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}

    def _fits(self, pname: str, names: list[str]) -> int:
        """The bytes the parameter takes in a group (0: it cannot be guessed, its tensors'
        aligned sizes exceed it)."""
        nbytes = align(self.params[pname].data.nbytes, 8)
        used = sum(align(self.specs[n].nbytes, 8) for n in names) + self.first.get(pname, 0)
        return nbytes if 0 < used <= nbytes else 0

    def _groups(self, by_param: dict[str, list[str]]) -> list[list[str]]:
        """Consecutive parameters of one device, up to `GROUP_BYTES` a group; a larger
        parameter is a group of its own (the buffers then take its size: as much as the
        one-parameter probe's copies of it)."""
        groups: dict[torch.device, list[list[str]]] = {}
        sizes: dict[torch.device, int] = {}
        for pname, names in by_param.items():
            device = self.params[pname].device
            nbytes = self._fits(pname, names)
            if not nbytes:
                continue
            budget = GROUP_BYTES.get(device.type, GROUP_BYTES["cpu"])
            mine = groups.setdefault(device, [[]])
            if sizes.get(device, 0) + nbytes > budget:
                mine.append([])
                sizes[device] = 0
            mine[-1].append(pname)
            sizes[device] = sizes.get(device, 0) + nbytes
        return [g for device_groups in groups.values() for g in device_groups if g]

    def probe(
        self,
        by_param: dict[str, list[str]],
        many: LoadMany,
        found: dict[str, tuple[str, int]],
    ) -> dict[str, list[str]]:
        """Place what the groups can into `found`; {parameter: its tensors}, for those not
        placed."""
        groups = self._groups(by_param)
        need: dict[torch.device, int] = {}
        for group in groups:
            device = self.params[group[0]].device
            total = sum(align(self.params[p].data.nbytes, 8) for p in group)
            need[device] = max(need.get(device, 0), total)
        for device, size in need.items():
            self.buffers[device] = (
                None if self.scratch else torch.empty(size, dtype=torch.uint8, device=device),
                torch.empty(size, dtype=torch.uint8, device=device),
                self._pool(device, size),
            )
        placed: set[str] = set()
        for group in groups:
            if not self.scratch:
                placed.update(self._probe(group, by_param, many, found))
                continue
            live = [self.params[p].data for p in group]
            try:
                placed.update(self._probe(group, by_param, many, found))
            finally:
                for pname, data in zip(group, live):
                    self.params[pname].data = data
        self.buffers.clear()
        return {p: names for p, names in by_param.items() if p not in placed}

    def _pool(self, device: torch.device, size: int) -> torch.Tensor:
        """`size` random bytes (a multiple of 8) on `device`; on the CPU, where making them
        takes a while, kept in `pools` for the next call."""
        kept = None if self.pools is None or device.type != "cpu" else self.pools.get(device)
        if kept is not None and kept.numel() >= size:
            return kept[:size]
        gen = torch.Generator(device=device).manual_seed(2)
        pool = torch.empty(size // 8, dtype=torch.int64, device=device)
        pool.random_(-(1 << 63), None, generator=gen)  # every bit random
        if self.pools is not None and device.type == "cpu":
            self.pools[device] = pool.view(torch.uint8)
        return pool.view(torch.uint8)

    def _probe(
        self,
        group: list[str],
        by_param: dict[str, list[str]],
        many: LoadMany,
        found: dict[str, tuple[str, int]],
    ) -> list[str]:
        """Probe one group; the parameters placed (their tensors into `found`). With
        `scratch`, each parameter's `.data` is left a view of the buffer `after` (the caller
        puts the live tensors back)."""
        specs = self.specs
        device = self.params[group[0]].device
        before, after, pool = self.buffers[device]
        if self.scratch:
            at = 0
            for pname in group:
                live = self.params[pname].data
                mine = after[at : at + live.nbytes].view(live.dtype).view(live.shape)
                self.params[pname].data = mine
                at += align(live.nbytes, 8)
        flats = [self.params[p].data.reshape(-1).view(torch.uint8) for p in group]
        typed: dict[str, torch.Tensor] = {}
        pairs: list[tuple[str, torch.Tensor]] = []
        runs: list[list[int]] = []  # [start, end): the guessed places, merged where they touch
        starts: list[int] = []
        at = 0
        strides = self._strides
        run = [-1, -1]  # the last of `runs`
        for pname, flat in zip(group, flats):
            starts.append(at)
            here = at + self.first.get(pname, 0)
            for name in by_param[pname]:
                spec = specs[name]
                shape, size = spec.shape, spec.nbytes
                view = typed.get(spec.dtype)
                if view is None:
                    view = typed[spec.dtype] = pool.view(_dtype(spec.dtype))
                stride = strides.get(shape)
                if stride is None:
                    stride = strides[shape] = torch.empty(shape, device="meta").stride()
                pairs.append((name, view.as_strided(shape, stride, here // view.element_size())))
                if run[1] == here:
                    run[1] = here + size
                else:
                    run = [here, here + size]
                    runs.append(run)
                here += (size + 7) & ~7
            at += align(flat.numel(), 8)
        total = at
        if self.scratch:
            # The loads land in `after` itself, zeroed; the pool's bytes at the guessed
            # places are then taken away (xor): what is left must be zeros.
            after[:total].zero_()
            many(pairs)
            for a, b in runs:
                if a % 8 == 0 and b % 8 == 0:
                    after[a:b].view(torch.int64).bitwise_xor_(pool[a:b].view(torch.int64))
                else:
                    after[a:b].bitwise_xor_(pool[a:b])
            differ = after[:total].view(torch.int64).nonzero()
        else:
            assert before is not None
            nbytes = [f.numel() for f in flats]
            pads = [(s + n, align(n, 8) - n) for s, n in zip(starts, nbytes) if n % 8]
            befores = [before[s : s + n] for s, n in zip(starts, nbytes)]
            afters = [after[s : s + n] for s, n in zip(starts, nbytes)]
            torch._foreach_copy_(befores, flats)
            try:
                many(pairs)
                torch._foreach_copy_(afters, flats)
            finally:
                torch._foreach_copy_(flats, befores)
            if pads:  # the bytes between parameters: zeros on both sides
                torch._foreach_zero_([b[s : s + k] for s, k in pads for b in (before, after)])
            torch._foreach_copy_([before[a:b] for a, b in runs], [pool[a:b] for a, b in runs])
            differ = (before[:total].view(torch.int64) != after[:total].view(torch.int64)).nonzero()
        bad: set[int] = set()
        if differ.numel():
            first = torch.tensor(starts, device=device) // 8
            bad = set((torch.searchsorted(first, differ.view(-1), right=True) - 1).tolist())
        placed = []
        for i, pname in enumerate(group):
            if i in bad:
                continue
            placed.append(pname)
            here = self.first.get(pname, 0)
            for name in by_param[pname]:
                found[name] = (pname, here)
                here += align(specs[name].nbytes, 8)
        return placed


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
        saved: torch.Tensor | None,
        names: list[str],
        load_many: LoadMany,
        element_size: int,
        *,
        fewest: int = 2,
    ) -> dict[str, int]:
        """{name: byte offset} of those of `names` the loader copied verbatim into `flat`,
        every other byte of `flat` being as in `saved` (None: zeros) ({} otherwise: the caller
        probes them one at a time). Puts `flat` back. Fewer than `fewest` keyed tensors (of
        at least 8 bytes): {}."""
        keyed = [n for n in names if self.specs[n].nbytes >= 8]
        if len(keyed) < fewest or len(keyed) >= 1 << _INDEX_BITS:
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
                    (n, raw.view(_dtype(self.specs[n].dtype)).view(self.specs[n].shape))
                    for n, raw in zip(keyed, raws)
                ]
            )
            starts = self._starts(flat, keys, element_size)  # [len(keyed)], -1: not found
            found = (starts >= 0).nonzero().view(-1)
            if found.numel() == 0:
                return {}
            at = starts[found]
            ends = at + torch.tensor(sizes, device=flat.device)[found]
            if int(ends.max()) > flat.numel():
                return {}
            expected = torch.zeros_like(flat) if saved is None else saved.clone()
            shift = at - words[found] * 8  # where each found tensor lies, against the pool
            if (
                found.numel() == len(keyed)
                and all(n % 8 == 0 for n in sizes)
                and bool((shift == shift[0]).all())
            ):  # all found, in pool order and back to back (experts of one parameter): one copy
                begin = int(at[0])
                expected[begin : begin + offsets[-1] + sizes[-1]] = pool[: offsets[-1] + sizes[-1]]
            else:
                which, byte = found.tolist(), at.tolist()
                torch._foreach_copy_(
                    [expected[b : b + sizes[i]] for i, b in zip(which, byte)],
                    [raws[i] for i in which],
                )
            if not torch.equal(flat, expected):
                return {}
            return dict(zip([keyed[i] for i in found.tolist()], at.tolist()))
        finally:
            if saved is None:
                flat.zero_()
            else:
                flat.copy_(saved)

    @staticmethod
    def _starts(flat: torch.Tensor, keys: torch.Tensor, element_size: int) -> torch.Tensor:
        """Each key's byte offset in `flat` (-1 where none): the first word of `flat` equal to
        it, at offsets that are multiples of 8 first, then (for keys not found there) at the
        other element offsets."""
        found = torch.full_like(keys, -1)
        mask = (1 << _INDEX_BITS) - 1
        none = torch.iinfo(torch.int64).max
        for r in range(0, 8, min(element_size, 8)):
            if r and bool((found >= 0).all()):
                break
            count = (flat.numel() - r) // 8
            if count <= 0:
                continue
            words = flat[r : r + 8 * count]
            words = (words if words.data_ptr() % 8 == 0 else words.clone()).view(torch.int64)
            index = (words & mask).clamp_(max=keys.numel() - 1)
            at = (keys[index] == words).nonzero().view(-1)
            first = torch.full_like(keys, none)  # the first match of each key in this pass
            first.scatter_reduce_(0, index[at], r + 8 * at, reduce="amin")
            found = torch.where((found < 0) & (first != none), first, found)
        return found


_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        _DTYPES[name] = dtype_from_str(name)
    return _DTYPES[name]


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
