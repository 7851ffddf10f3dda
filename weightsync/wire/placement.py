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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from weightsync.wire.fingerprint import (
    MASK,
    PRIMES,
    ROOTS,
    Fingerprint,
    combine,
    fingerprint,
    shift,
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
    return learn_placements(param, [(dtype, shape)], lambda pairs: load_one(pairs[0][1]))[0]


LEARNED_ELEMENTS = 1 << 25  # the most tensor elements learned in one load (int64 indices)


def learn_placements(
    param: torch.Tensor,
    items: list[tuple[torch.dtype, tuple[int, ...]]],
    load: Callable[[list[tuple[int, torch.Tensor]]], Any],
) -> list[list[Pattern] | None]:
    """`learn_placement` for several trainer tensors that land in one parameter (an MoE
    layer's experts, q/k/v), in a few loads of all of them together: `load([(i, tensor), ...])`
    loads each `tensor` as the trainer tensor of `items[i]` (its dtype and shape), in the
    order given. Every element of every tensor
    carries its own index among all of them, so one zeroed scratch copy of the parameter per
    pass serves them all (learned one at a time, each tensor would zero and scan the whole
    parameter: an expert's cost would grow with its layer's size). The random-bytes pass loads
    them in reverse order: tensors that overwrite each other's places then disagree with the
    map, and such a set is learned one tensor at a time. At most `LEARNED_ELEMENTS` elements
    go in one load."""
    out: list[list[Pattern] | None] = [None] * len(items)
    sizes = {1, 2, 4, 8}
    todo = []
    for i, (dtype, shape) in enumerate(items):
        if dtype != param.dtype or torch.empty((), dtype=dtype).element_size() not in sizes:
            continue
        if math.prod(shape) == 0:
            out[i] = []
        else:
            todo.append(i)
    chunk: list[int] = []
    count = 0
    chunks = []
    for i in todo:
        numel = math.prod(items[i][1])
        if chunk and count + numel > LEARNED_ELEMENTS:
            chunks.append(chunk)
            chunk, count = [], 0
        chunk.append(i)
        count += numel
    if chunk:
        chunks.append(chunk)
    for chunk in chunks:
        learned = _learn(param, [items[i][1] for i in chunk], chunk, load)
        if learned is None and len(chunk) > 1:  # one at a time
            learned = [(_learn(param, [items[i][1]], [i], load) or [None])[0] for i in chunk]
        for i, pats in zip(chunk, learned or [None] * len(chunk)):
            out[i] = pats
    return out


def _learn(
    param: torch.Tensor,
    shapes: list[tuple[int, ...]],
    ids: list[int],
    load: Callable[[list[tuple[int, torch.Tensor]]], Any],
) -> list[list[Pattern] | None] | None:
    """The patterns of the tensors `ids` of `shapes` (of the parameter's dtype, none empty)
    loaded together; None when the loader does not copy them verbatim into the parameter (or
    copies one over another)."""
    dtype, device = param.dtype, param.device
    size = param.element_size()
    signed = _SIGNED[size]
    numels = [math.prod(shape) for shape in shapes]
    starts = [0]
    for n in numels[:-1]:
        starts.append(starts[-1] + n)
    total = starts[-1] + numels[-1]
    bits = 8 * size - 1
    live = param.data
    scratch = torch.zeros_like(live)
    flat = scratch.reshape(-1).view(signed)
    index = torch.arange(total, dtype=torch.int64, device=device)
    found: torch.Tensor | None = None
    where: torch.Tensor | None = None

    def pieces(whole: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        return [
            (i, whole[s : s + n].view(shape)) for i, s, n, shape in zip(ids, starts, numels, shapes)
        ]

    try:
        param.data = scratch
        with torch.no_grad():
            for k in range(_passes(total, bits)):
                code = ((index >> (k * bits)) & ((1 << bits) - 1)) - (1 << bits)
                scratch.zero_()
                load(pieces(code.to(signed).view(dtype)))
                marked = flat < 0
                positions = marked.nonzero().reshape(-1)
                part = (flat[positions].to(torch.int64) + (1 << bits)) << (k * bits)
                if where is None or found is None:
                    where, found = positions, part
                elif not torch.equal(where, positions):
                    return None  # the loader wrote different places for different values
                else:
                    found |= part
            del index
            if where is None or found is None or where.numel() == 0 or int(found.max()) >= total:
                return None
            # Verbatim? Random bits through the loader must sit exactly where the map says,
            # loaded in reverse order: a tensor copied over another's place would now lose.
            raw = torch.randint(
                -(1 << 7),
                1 << 7,
                (total * size,),
                dtype=torch.int8,
                device=device,
                generator=torch.Generator(device=device).manual_seed(1),
            )
            scratch.zero_()
            load(pieces(raw.view(dtype))[::-1])
            source = raw.view(signed)
            if not torch.equal(flat[where], source[found]):
                return None
            flat[where] = 0
            if bool(flat.any()):
                return None  # it also wrote elsewhere
    finally:
        param.data = live
    return patterns_of(where.cpu(), found.cpu(), starts)


def patterns(dst: torch.Tensor, src: torch.Tensor) -> list[Pattern]:
    """Compress a sorted destination -> source element map into strided runs."""
    return patterns_of(dst, src, [0])[0] or []


def patterns_of(
    dst: torch.Tensor, src: torch.Tensor, starts: list[int]
) -> list[list[Pattern] | None]:
    """`patterns` for several tensors at once: `src` indexes the tensors laid back to back
    (tensor i's elements from `starts[i]` on), `dst` is sorted; each tensor's patterns use its
    own element indices (None for a tensor of which no element landed)."""
    if dst.numel() == 0:
        return [None] * len(starts)
    first = torch.tensor(starts, dtype=torch.int64)
    owner = torch.searchsorted(first, src, right=True) - 1
    if len(starts) > 1 and not bool((owner[1:] >= owner[:-1]).all()):
        order = torch.sort(owner, stable=True).indices  # by tensor, each in destination order
        dst, owner, src = dst[order], owner[order], src[order]
    src = src - first[owner]
    breaks = ((dst[1:] - dst[:-1]) != 1) | ((src[1:] - src[:-1]) != 1) | (owner[1:] != owner[:-1])
    begin = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().reshape(-1) + 1])
    ends = torch.cat([begin[1:], torch.tensor([dst.numel()])])
    counts = torch.bincount(owner, minlength=len(starts)).tolist()
    out: list[list[Pattern] | None] = [[] if c else None for c in counts]
    runs = zip(
        dst[begin].tolist(), src[begin].tolist(), (ends - begin).tolist(), owner[begin].tolist()
    )
    for d, s, n, i in runs:
        pats = out[i]
        assert pats is not None
        if pats:
            p = pats[-1]
            if p[2] == n:
                if p[3] == 1 and d > p[0] and s >= p[1] + n:
                    p[3], p[4], p[5] = 2, d - p[0], s - p[1]
                    continue
                if p[3] > 1 and d == p[0] + p[3] * p[4] and s == p[1] + p[3] * p[5]:
                    p[3] += 1
                    continue
        pats.append([d, s, n, 1, 0, 0])
    return out


def pattern_view(flat: torch.Tensor, pattern: Pattern, *, dst: bool = False) -> torch.Tensor:
    """The elements of a pattern in a flat contiguous tensor, as a (count, length) view: the
    destination side with `dst`, else the source side."""
    start, stride = (pattern[0], pattern[4]) if dst else (pattern[1], pattern[5])
    return flat.as_strided((pattern[3], pattern[2]), (stride, 1), flat.storage_offset() + start)


Block = tuple[int, int, tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]
"""(dst, src, sizes, dst strides, src strides): consecutive patterns alike but for their starts,
which step by the same amounts, as one 3-d strided view of each side."""


def blocks(pats: list[Pattern]) -> list[Block]:
    """`pats` as few strided views: a transposed tensor's one pattern per row is one block."""
    out: list[list] = []  # [dst, src, n, length, count, dst_step, src_step, dst_stride, src_stride]
    for d, s, length, count, d_stride, s_stride in pats:
        if out:
            b = out[-1]
            if (b[3], b[4], b[7], b[8]) == (length, count, d_stride, s_stride):
                if b[2] == 1 and d > b[0] and s >= b[1]:  # as_strided takes no negative step
                    b[2], b[5], b[6] = 2, d - b[0], s - b[1]
                    continue
                if b[2] > 1 and d == b[0] + b[2] * b[5] and s == b[1] + b[2] * b[6]:
                    b[2] += 1
                    continue
        out.append([d, s, 1, length, count, 0, 0, d_stride, s_stride])
    return [(b[0], b[1], (b[2], b[4], b[3]), (b[5], b[7], 1), (b[6], b[8], 1)) for b in out]


def placed_prints(flat: torch.Tensor, pats: list[Pattern]) -> Fingerprint:
    """The contribution to a parameter's fingerprint of the elements of `flat` (a flat tensor)
    that `pats` place in it: those elements laid where they go in a zeroed span of the
    parameter (bit for bit, through integer views), fingerprinted once and shifted to where
    the span starts (zeros add nothing to a fingerprint). The same as combining `placed` over
    the patterns, in a few copies instead of a fingerprint per pattern."""
    lo = min(p[0] for p in pats)
    hi = max(p[0] + (p[3] - 1) * p[4] + p[2] for p in pats)
    span = torch.zeros(hi - lo, dtype=flat.dtype, device=flat.device)
    signed = _SIGNED.get(flat.element_size())
    dst, src = (span, flat) if signed is None else (span.view(signed), flat.view(signed))
    offset = src.storage_offset()
    for d, s, sizes, d_strides, s_strides in blocks(pats):
        dst.as_strided(sizes, d_strides, d - lo).copy_(src.as_strided(sizes, s_strides, offset + s))
    return shift(fingerprint(span), lo * words_per_element(flat.dtype))


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
                if pats:
                    parts.setdefault(pname, []).append(placed_prints(flat, pats))

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


_SLICED: dict[int, tuple[Any, Any, bool]] = {}  # id(placements) -> (placements, specs, answer)


def sliced(placements: dict[str, Any], specs: dict[str, Any]) -> bool:
    """Whether some tensor of one worker's placements is not placed whole (`whole_offset`):
    its expected fingerprints then need the tensor's elements (`WorkerPrints`). Asked at every
    verified sync: the answer is kept while the placements and specs are the same objects."""
    kept = _SLICED.get(id(placements))
    if kept is not None and kept[0] is placements and kept[1] is specs:
        return kept[2]
    answer = any(
        pats and (name not in specs or whole_offset(pats, specs[name].numel) is None)
        for name, (_, pats) in placements.items()
    )
    if len(_SLICED) >= 64:
        _SLICED.clear()
    _SLICED[id(placements)] = (placements, specs, answer)
    return answer


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
    does not (its expected fingerprint needs the tensor's elements) or was not sent. The same
    as `shift`ing each tensor's fingerprint to its `whole_offset` and `combine`ing them per
    parameter (`WholePrints`, made for this call; a verified sync keeps its plans)."""
    plan = WholePrints(placements, list(sent), specs)
    return plan.prints(sent_table(sent.values())) if plan.whole else None


def sent_table(prints: Iterable[Fingerprint]) -> torch.Tensor:
    """Fingerprints as `FingerprintBatch.read_table` holds them: [N, 3] int64, s signed."""
    rows = [(s - (1 << 64) if s >> 63 else s, h1, h2) for s, h1, h2 in prints]
    return torch.tensor(rows, dtype=torch.int64).view(-1, 3)


class WholePrints:
    """`prints_from_sent` for one worker's placements, as array arithmetic on the sent
    fingerprints' table (`FingerprintBatch.read_table`, rows in `order`): the per-tensor walk
    is made once and kept (`of`) while the placements, the order and the specs are the same,
    and every verified sync then computes its expected fingerprints without a step per tensor.
    `whole` is False where some placed tensor does not lie whole and in order in its parameter
    or was not sent (`prints_from_sent` gives None there)."""

    _kept: dict[int, tuple[Any, list[str], Any, WholePrints]] = {}
    _KEEP = 64  # (worker placements) entries kept; dropped all at once past it

    def __init__(self, placements: dict[str, Any], order: list[str], specs: dict[str, Any]):
        at = {name: i for i, name in enumerate(order)}
        rows: list[int] = []
        params: list[int] = []
        shifts: list[tuple[int, int]] = []
        self.names: list[str] = []
        index: dict[str, int] = {}
        self.whole = True
        for name, (pname, pats) in placements.items():
            if not pats:
                continue
            spec, row = specs.get(name), at.get(name)
            if spec is None or row is None or len(pats) != 1:
                self.whole = False
                break
            dst, src, length, count, _, _ = pats[0]
            if src or count != 1 or length != spec.numel:
                self.whole = False
                break
            per = _WORDS.get(spec.dtype)
            if per is None:
                per = _WORDS[spec.dtype] = words_per_element(dtype_from_str(spec.dtype))
            k = index.get(pname)
            if k is None:
                k = index[pname] = len(self.names)
                self.names.append(pname)
            rows.append(row)
            params.append(k)
            shifts.append(_powers(dst * per) if dst else (1, 1))
        self._rows = torch.tensor(rows, dtype=torch.int64)
        self._params = torch.tensor(params, dtype=torch.int64)
        self._shifts = torch.tensor(shifts, dtype=torch.int64).view(-1, 2)
        self._primes = torch.tensor(PRIMES, dtype=torch.int64)

    @classmethod
    def of(cls, placements: dict[str, Any], order: list[str], specs: dict[str, Any]) -> WholePrints:
        """The kept plan for these placements, order and specs, or a new one."""
        kept = cls._kept.get(id(placements))
        if kept is not None and kept[0] is placements and kept[2] is specs and kept[1] == order:
            return kept[3]
        if len(cls._kept) >= cls._KEEP:
            cls._kept.clear()
        plan = cls(placements, order, specs)
        cls._kept[id(placements)] = (placements, list(order), specs, plan)
        return plan

    def prints(self, table: torch.Tensor) -> dict[str, Fingerprint]:
        """{parameter: expected fingerprint} from the sent table (rows in this plan's order)."""
        sel = table[self._rows]
        hashes = sel[:, 1:] * self._shifts % self._primes  # each below 2**42
        acc = torch.zeros((len(self.names), 3), dtype=torch.int64)
        acc[:, :1].index_add_(0, self._params, sel[:, :1])  # wraps mod 2**64, as s does
        acc[:, 1:].index_add_(0, self._params, hashes)
        acc[:, 1:] = acc[:, 1:].remainder(self._primes)
        return {p: (s & MASK, h1, h2) for p, (s, h1, h2) in zip(self.names, acc.tolist())}


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
