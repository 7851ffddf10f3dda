"""A transfer plan: which trainer rank sends which elements of which tensor to which engine worker.

Past one host, a sync moves each byte once, from a rank that holds it to each worker that needs
it, over many links at once, instead of gathering every tensor on rank 0. Both ends are known:
each trainer rank holds runs of each flat tensor (FSDP2 shards along dim 0: one run a rank,
several ranks holding the same run under HSDP or for a replicated tensor), and each engine
worker's placements (weightsync/wire/placement.py, learned from its own loader) say which
source elements it keeps and where. The plan joins them, once per pair of layouts:

- every element a worker keeps comes from exactly one rank that holds it (none twice, none
  through a rank that does not hold it: rank 0 sends only its own shards);
- where several ranks hold an element, the one that has sent the fewest bytes so far sends it
  (greedy, in tensor order), so no rank carries much more than its share;
- a move keeps the placement's form, `[tensor, dst, src, length, count, dst_stride,
  src_stride]` (weightsync/wire/placement.py `Pattern` with the tensor's name in front): the
  worker writes each element straight to its place in the parameter.

Plain data in and out (`TransferPlan.to_dict`), no torch: the same planner runs in a trainer, in
an engine worker, and in the simulator (weightsync/apps/scale.py) fed real models' layouts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Pattern = list[int]  # [dst, src, length, count, dst_stride, src_stride], as in placement.py
Holding = tuple[int, int, int]  # (rank, start, stop): elements [start, stop) of the flat tensor
Move = list[Any]  # [tensor, dst, src, length, count, dst_stride, src_stride]


def clip(pattern: Pattern, start: int, stop: int) -> list[Pattern]:
    """The part of `pattern` whose source elements lie in [start, stop), as at most three
    patterns (a clipped first run, the runs wholly inside, a clipped last run): O(1) whatever
    the count, so a column slice of a 100k-row matrix costs no more than a row slice."""
    dst, src, length, count, dst_stride, src_stride = pattern
    if count == 1:
        a, b = max(src, start), min(src + length, stop)
        return [[dst + a - src, a, b - a, 1, 0, 0]] if a < b else []
    # Placement patterns of several runs step forward without overlap (placement.patterns).
    assert src_stride >= length > 0, pattern
    lo = max(0, (start - src - length) // src_stride + 1)  # first run ending after start
    hi = min(count - 1, (stop - 1 - src) // src_stride)  # last run starting before stop
    out: list[Pattern] = []
    i = lo
    while i <= hi:
        run = src + i * src_stride
        if run >= start and run + length <= stop:
            last = min(hi, (stop - length - src) // src_stride)  # the last run wholly inside
            n = last - i + 1
            strides = (dst_stride, src_stride) if n > 1 else (0, 0)
            out.append([dst + i * dst_stride, run, length, n, *strides])
            i = last + 1
        else:
            a, b = max(run, start), min(run + length, stop)
            out.append([dst + i * dst_stride + a - run, a, b - a, 1, 0, 0])
            i += 1
    return out


def pattern_elements(pattern: Pattern) -> int:
    return pattern[2] * pattern[3]


def fsdp_holdings(shape: tuple[int, ...] | list[int], ranks: int | list[int]) -> list[Holding]:
    """The runs FSDP2's `Shard(0)` gives each of `ranks` (a count, or the ranks of the mesh in
    mesh order) of a tensor of `shape`: `torch.chunk` along dim 0, so every rank's part is one
    run of the flat tensor, chunks of ceil(rows / ranks) rows, the last ranks' empty when rows
    run out. A 0-d tensor is held whole by every rank."""
    order = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
    if not shape:
        return [(r, 0, 1) for r in order]
    rows, row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // len(order)) if rows else 0
    out: list[Holding] = []
    for i, rank in enumerate(order):
        first, last = min(i * chunk, rows), min((i + 1) * chunk, rows)
        if last > first:
            out.append((rank, first * row, last * row))
    return out


class _Segments:
    """A tensor cut at every holding's ends: each piece with the ranks that hold all of it."""

    def __init__(self, holdings: Iterable[Holding]) -> None:
        held = list(holdings)
        cuts = sorted({x for _, start, stop in held for x in (start, stop)})
        self.starts = cuts[:-1]
        self.stops = cuts[1:]
        self.ranks: list[list[int]] = [[] for _ in self.starts]
        for rank, start, stop in held:
            for i in range(bisect.bisect_left(cuts, start), bisect.bisect_left(cuts, stop)):
                self.ranks[i].append(rank)

    def overlapping(self, start: int, stop: int) -> range:
        """Indices of the pieces that overlap [start, stop)."""
        return range(
            max(0, bisect.bisect_right(self.stops, start)), bisect.bisect_left(self.starts, stop)
        )


@dataclass(slots=True)
class TransferPlan:
    """Which rank sends which runs of which tensor to which worker (module docstring).

    `moves[(rank, worker)]`: that link's moves, in tensor order. `element_bytes`: each tensor's
    element size. `weights`: how many tensors each stands for (1 for a real plan; the simulator
    plans one tensor of each kind and weights it by how many the model has)."""

    num_ranks: int
    num_workers: int
    element_bytes: dict[str, int]
    moves: dict[tuple[int, int], list[Move]] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)

    def _weight(self, move: Move) -> int:
        return self.weights.get(move[0], 1)

    def move_bytes(self, move: Move) -> int:
        return move[3] * move[4] * self.element_bytes[move[0]] * self._weight(move)

    def sends(self, rank: int) -> dict[int, list[Move]]:
        """{worker: moves} of one rank: what it sends, to whom."""
        return {w: m for (r, w), m in self.moves.items() if r == rank}

    def receives(self, worker: int) -> dict[int, list[Move]]:
        """{rank: moves} of one worker: what it receives, from whom."""
        return {r: m for (r, w), m in self.moves.items() if w == worker}

    def link_bytes(self) -> dict[tuple[int, int], int]:
        return {link: sum(map(self.move_bytes, m)) for link, m in self.moves.items()}

    def summary(self) -> dict[str, Any]:
        """Per-rank and per-worker totals: bytes, links (one message each a sync), pieces (runs
        of one tensor: each is a descriptor and a copy at both ends)."""
        out_bytes = [0] * self.num_ranks
        in_bytes = [0] * self.num_workers
        out_links = [0] * self.num_ranks
        in_links = [0] * self.num_workers
        out_pieces = [0] * self.num_ranks
        in_pieces = [0] * self.num_workers
        for (r, w), moves in self.moves.items():
            nbytes = sum(map(self.move_bytes, moves))
            pieces = sum(map(self._weight, moves))
            out_bytes[r] += nbytes
            in_bytes[w] += nbytes
            out_links[r] += 1
            in_links[w] += 1
            out_pieces[r] += pieces
            in_pieces[w] += pieces
        return {
            "total_bytes": sum(out_bytes),
            "rank_bytes": out_bytes,
            "worker_bytes": in_bytes,
            "rank_links": out_links,
            "worker_links": in_links,
            "rank_pieces": out_pieces,
            "worker_pieces": in_pieces,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_ranks": self.num_ranks,
            "num_workers": self.num_workers,
            "element_bytes": dict(self.element_bytes),
            "links": [[r, w, moves] for (r, w), moves in self.moves.items()],
            "weights": dict(self.weights),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransferPlan:
        return cls(
            num_ranks=int(d["num_ranks"]),
            num_workers=int(d["num_workers"]),
            element_bytes={str(k): int(v) for k, v in d["element_bytes"].items()},
            moves={(int(r), int(w)): [list(m) for m in moves] for r, w, moves in d["links"]},
            weights={str(k): int(v) for k, v in d.get("weights", {}).items()},
        )


def plan_transfers(
    element_bytes: Mapping[str, int],
    holdings: Mapping[str, Iterable[Holding]],
    workers: Sequence[Mapping[str, Any]],
    *,
    num_ranks: int,
    weights: Mapping[str, int] | None = None,
) -> TransferPlan:
    """The plan that brings each of `workers` (its placements: {tensor: [parameter, [pattern,
    ...]]}) the elements it keeps, from the ranks of `holdings` ({tensor: [(rank, start, stop),
    ...]}). Tensors are planned in the order of `element_bytes`. Raises ValueError, naming the
    tensor and the elements, when a worker keeps elements no rank holds."""
    weights = dict(weights or {})
    for w, placed in enumerate(workers):
        unknown = [name for name in placed if name not in element_bytes]
        if unknown:
            raise ValueError(
                f"worker {w} keeps tensors the trainer does not send: {sorted(unknown)[:4]} "
                f"({len(unknown)} in all); the engine's placements must name the trainer's "
                "tensors (was it connected to another model?)"
            )
    plan = TransferPlan(num_ranks, len(workers), dict(element_bytes), weights=weights)
    load = [0] * num_ranks
    for name, size in element_bytes.items():
        wanted = [(w, placed[name][1]) for w, placed in enumerate(workers) if name in placed]
        if not wanted:
            continue
        segments = _Segments(holdings.get(name, ()))
        scale = size * weights.get(name, 1)
        for w, patterns in wanted:
            for pattern in patterns:
                first, count, stride = pattern[1], pattern[3], pattern[5]
                span = (first, first + (count - 1) * stride + pattern[2])
                covered = 0
                for i in segments.overlapping(*span):
                    ranks = segments.ranks[i]
                    pieces = clip(pattern, segments.starts[i], segments.stops[i]) if ranks else []
                    if not pieces:
                        continue
                    rank = min(ranks, key=lambda r: (load[r], r))
                    elements = sum(map(pattern_elements, pieces))
                    covered += elements
                    load[rank] += elements * scale
                    plan.moves.setdefault((rank, w), []).extend([name, *p] for p in pieces)
                if covered != pattern_elements(pattern):
                    raise ValueError(
                        f"tensor {name!r}: worker {w} keeps {pattern_elements(pattern)} elements "
                        f"of pattern {pattern} but the trainer's ranks hold only {covered} of "
                        "them; the holdings must cover every element an engine keeps (is the "
                        "trainer's layout the one the engine was connected with?)"
                    )
    return plan


class PlanCache:
    """The plan for the latest pair of layouts: made once per pair, made again when the
    trainer's key or the engines' key changes (a reshard, another world size; an engine whose
    placements grew or that joined or left)."""

    def __init__(self) -> None:
        self._key: tuple[Hashable, Hashable] | None = None
        self._plan: TransferPlan | None = None
        self.num_planned = 0

    def get(
        self, trainer_key: Hashable, engines_key: Hashable, make: Callable[[], TransferPlan]
    ) -> TransferPlan:
        key = (trainer_key, engines_key)
        if self._plan is None or self._key != key:
            self._plan, self._key = make(), key
            self.num_planned += 1
        return self._plan
