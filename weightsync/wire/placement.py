"""Where an engine worker's loader puts each element of a trainer tensor: placements.

A tensor-parallel engine worker holds a slice of each full tensor it is sent: its loader narrows
the tensor (rows for column-parallel layers, columns for row-parallel ones, a head range of each
of q, k and v in a fused QKV parameter) and copies that slice into its own parameter. To check
such a worker against what it holds, and to write only its slice into it, the trainer needs to
know which elements of which tensor land where. Nothing here knows a model: the engine worker
learns it from its own loader (`learn_placement`), once per tensor, on a scratch copy of the
parameter swapped in as `param.data` (the live weights are never touched).

How: the loader is fed a tensor whose every element carries its own index (in the element's
integer bits, the sign bit set as a "written" mark, a few passes for large tensors) into a
zeroed scratch parameter; the marked elements of the scratch say which destination holds which
source element. A last pass with random bytes confirms that the loader copies bits verbatim
(a dtype conversion or arithmetic would not survive it); otherwise the tensor has no placement.

A placement is a list of patterns, each `[dst, src, length, count, dst_stride, src_stride]` in
elements of the flat parameter and the flat tensor: `count` runs of `length` consecutive
elements, the i-th starting at `dst + i * dst_stride` / `src + i * src_stride`. A narrow along
dim 0 is one pattern of one run; along dim 1 of a matrix, one pattern of one run per row.
Only plain data crosses: {tensor name: [parameter name, [pattern, ...]]}.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from weightsync.wire.fingerprint import (
    MASK,
    PRIMES,
    ROOTS,
    Fingerprint,
    combine,
    placed,
    words_per_element,
)
from weightsync.wire.specs import dtype_from_str

Pattern = list[int]  # [dst, src, length, count, dst_stride, src_stride]
Placement = tuple[str, list[Pattern]]  # (parameter name, patterns)

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _passes(numel: int, bits: int) -> int:
    return max(1, math.ceil(math.log2(max(numel, 2)) / bits))


def learn_placement(
    param: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    load_one: Callable[[torch.Tensor], Any],
) -> list[Pattern] | None:
    """The patterns by which `load_one(tensor)` (the engine's loader for one trainer tensor of
    `dtype` and `shape`) places elements into `param`, or None when it does not copy them
    verbatim into that one parameter. `param.data` is a zeroed scratch copy meanwhile and is
    put back afterwards, whatever happens."""
    if param.dtype != dtype:
        return None
    device = param.device
    size = torch.empty((), dtype=dtype).element_size()
    signed = _SIGNED.get(size)
    if signed is None:
        return None
    numel = math.prod(shape)
    if numel == 0:
        return []
    bits = 8 * size - 1
    live = param.data
    scratch = torch.zeros_like(live)
    flat = scratch.reshape(-1).view(signed)
    index = torch.arange(numel, dtype=torch.int64, device=device)
    found: torch.Tensor | None = None
    where: torch.Tensor | None = None
    try:
        param.data = scratch
        with torch.no_grad():
            for k in range(_passes(numel, bits)):
                code = ((index >> (k * bits)) & ((1 << bits) - 1)) - (1 << bits)
                scratch.zero_()
                load_one(code.to(signed).view(dtype).view(shape))
                marked = flat < 0
                positions = marked.nonzero().reshape(-1)
                part = (flat[positions].to(torch.int64) + (1 << bits)) << (k * bits)
                if where is None or found is None:
                    where, found = positions, part
                elif not torch.equal(where, positions):
                    return None  # the loader wrote different places for different values
                else:
                    found |= part
            if where is None or found is None or where.numel() == 0 or int(found.max()) >= numel:
                return None
            # Verbatim? Random bits through the loader must sit exactly where the map says.
            raw = torch.randint(
                -(1 << 7),
                1 << 7,
                (numel * size,),
                dtype=torch.int8,
                device=device,
                generator=torch.Generator(device=device).manual_seed(1),
            )
            scratch.zero_()
            load_one(raw.view(dtype).view(shape))
            source = raw.view(signed)
            if not torch.equal(flat[where], source[found]):
                return None
            flat[where] = 0
            if bool(flat.any()):
                return None  # it also wrote elsewhere
    finally:
        param.data = live
    return patterns(where.cpu(), found.cpu())


def patterns(dst: torch.Tensor, src: torch.Tensor) -> list[Pattern]:
    """Compress a sorted destination -> source element map into strided runs."""
    if dst.numel() == 0:
        return []
    breaks = ((dst[1:] - dst[:-1]) != 1) | ((src[1:] - src[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().reshape(-1) + 1])
    ends = torch.cat([starts[1:], torch.tensor([dst.numel()])])
    out: list[Pattern] = []
    for d, s, n in zip(dst[starts].tolist(), src[starts].tolist(), (ends - starts).tolist()):
        if out:
            p = out[-1]
            if p[2] == n:
                if p[3] == 1 and d > p[0] and s >= p[1] + n:
                    p[3], p[4], p[5] = 2, d - p[0], s - p[1]
                    continue
                if p[3] > 1 and d == p[0] + p[3] * p[4] and s == p[1] + p[3] * p[5]:
                    p[3] += 1
                    continue
        out.append([d, s, n, 1, 0, 0])
    return out


def pattern_view(flat: torch.Tensor, pattern: Pattern, *, dst: bool = False) -> torch.Tensor:
    """The elements of a pattern in a flat contiguous tensor, as a (count, length) view: the
    destination side with `dst`, else the source side."""
    start, stride = (pattern[0], pattern[4]) if dst else (pattern[1], pattern[5])
    return flat.as_strided((pattern[3], pattern[2]), (stride, 1), flat.storage_offset() + start)


class WorkerPrints:
    """What each parameter of each worker of one engine must fingerprint to, combined over the
    trainer's tensors as they stream past (`add`): for a parameter, the combination over its
    placed tensors of the contributions of the elements the worker holds, where it holds them
    (weightsync/wire/fingerprint.py)."""

    def __init__(self, workers: list[dict[str, Any]]) -> None:
        self.workers = workers
        self._parts: list[dict[str, list[Fingerprint]]] = [{} for _ in workers]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1)
        for placements, parts in zip(self.workers, self._parts):
            if name in placements:
                pname, pats = placements[name]
                parts.setdefault(pname, []).extend(
                    placed(pattern_view(flat, p), p[0], p[4]) for p in pats
                )

    def result(self) -> list[dict[str, Fingerprint]]:
        return [{p: combine(prints) for p, prints in parts.items()} for parts in self._parts]


def whole_offset(patterns: list[Pattern], numel: int) -> int | None:
    """The parameter element at which a tensor placed whole and in order starts (the common
    case at TP=1: a parameter of its own, or q, k, v in a fused one); None for a slice or any
    other arrangement."""
    if len(patterns) == 1:
        dst, src, length, count, _, _ = patterns[0]
        if src == 0 and count == 1 and length == numel:
            return dst
    return None


def sliced(placements: dict[str, Any], specs: dict[str, Any]) -> bool:
    """Whether some tensor of one worker's placements is not placed whole (`whole_offset`):
    its expected fingerprints then need the tensor's elements (`WorkerPrints`)."""
    return any(
        pats and (name not in specs or whole_offset(pats, specs[name].numel) is None)
        for name, (_, pats) in placements.items()
    )


_WORDS: dict[str, int] = {}  # dtype name -> fingerprint words per element
_POWERS: dict[int, tuple[int, int]] = {}  # word offset -> (r1**o mod p1, r2**o mod p2)
_POWERS_KEPT = 1 << 20  # offsets repeat across layers; the table is dropped when it grows past


def _powers(words: int) -> tuple[int, int]:
    pw = _POWERS.get(words)
    if pw is None:
        if len(_POWERS) >= _POWERS_KEPT:
            _POWERS.clear()
        pw = _POWERS[words] = (pow(ROOTS[0], words, PRIMES[0]), pow(ROOTS[1], words, PRIMES[1]))
    return pw


def prints_from_sent(
    placements: dict[str, Any], sent: dict[str, Fingerprint], specs: dict[str, Any]
) -> dict[str, Fingerprint] | None:
    """`WorkerPrints` for one worker from the sent tensors' fingerprints alone (`specs`: name
    -> its TensorSpec), where every placed tensor lies whole in its parameter; None when some
    does not (its expected fingerprint needs the tensor's elements). The same as `shift`ing
    each tensor's fingerprint to its `whole_offset` and `combine`ing them per parameter, in one
    pass with no call per tensor (it runs at every verified sync, over every tensor)."""
    p1, p2 = PRIMES
    acc: dict[str, list[int]] = {}
    for name, (pname, pats) in placements.items():
        if not pats:
            continue
        spec = specs.get(name)
        fp = sent.get(name)
        if spec is None or fp is None or len(pats) != 1:
            return None
        dst, src, length, count, _, _ = pats[0]
        if src or count != 1 or length != spec.numel:
            return None  # not whole and in order (`whole_offset`)
        s, h1, h2 = fp
        if dst:
            per = _WORDS.get(spec.dtype)
            if per is None:
                per = _WORDS[spec.dtype] = words_per_element(dtype_from_str(spec.dtype))
            r1, r2 = _powers(dst * per)
            h1, h2 = h1 * r1 % p1, h2 * r2 % p2
        kept = acc.get(pname)
        if kept is None:
            acc[pname] = [s, h1, h2]
        else:
            kept[0] += s
            kept[1] += h1
            kept[2] += h2
    return {p: (v[0] & MASK, v[1] % p1, v[2] % p2) for p, v in acc.items()}


def expected_worker_fingerprints(
    tensors: dict[str, torch.Tensor], placements: dict[str, Any]
) -> dict[str, Fingerprint]:
    """`WorkerPrints` for one worker and tensors at hand."""
    prints = WorkerPrints([placements])
    for name, tensor in tensors.items():
        prints.add(name, tensor)
    return prints.result()[0]


def placed_params(param_of: dict[str, list[str]], placements: dict[str, Any]) -> set[str]:
    """Parameters every tensor of which has a placement: those a worker can be checked on."""
    unplaced = {p for name, targets in param_of.items() if name not in placements for p in targets}
    return {pname for pname, _ in placements.values()} - unplaced
