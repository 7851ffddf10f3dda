"""Trainer ranks moving their own FSDP2 shards in bulk, with no all-gather per tensor.

FSDP2 shards every tensor along dim 0, so a rank's shard is one contiguous byte range of the
full tensor (`ShardPieces`): each rank can copy its own range to its place.
  - `BucketShardWriter`: into the shared-memory bucket the sender is about to hand the engines.
  - `BucketGatherWriter`: for transports whose bucket only rank 0 can write (cuda_ipc, gloo,
    nccl): every rank packs its shards of a bucket's tensors into one flat buffer, one gather per
    bucket brings them to rank 0, and rank 0 copies each rank's runs to their places.
  - `OneCopyWriter`: straight into the engines' shared parameters (weightsync/trainer/one_copy/targets.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from weightsync.gpu import copies
from weightsync.gpu.copies import ONE_COPY_BYTES
from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.trainer.sync_group import SyncGroup
from weightsync.wire.bucket import BucketPlan, plan_buckets

# Called on rank 0 before it writes bucket or piece `index`: ("bucket" | "piece", index). The
# reliability tests set it on the writers after construction (the worker's
# `pause_before_write`) and pause there to kill a process mid-sync.
BeforeWrite = Callable[[str, int], None]


def _write_pieces(
    got: list[tuple[str, torch.Tensor | None, int]],
    plan: BucketPlan,
    buffer: torch.Tensor,
    cache: _CopyLists | None = None,
    walk: list | None = None,
) -> None:
    """Copy this rank's pieces `got` of `plan`'s tensors into the bucket at their offsets
    (`walk`: the list `got` was taken from, see `_CopyLists.get`)."""

    def build() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dsts, srcs = [], []
        for meta, (name, data, offset) in zip(plan.tensors, got, strict=True):
            if name != meta.name:
                raise RuntimeError(
                    f"shard stream gave {name!r} where the bucket plan has "
                    f"{meta.name!r}: the model changed since refit info was taken"
                )
            if data is not None and data.numel():
                start = meta.offset + offset
                dsts.append(buffer[start : start + data.nbytes])
                srcs.append(data.reshape(-1).view(torch.uint8))
        return dsts, srcs

    if cache is None:
        _copy(*_split(*build()))
    else:
        _copy(*cache.get(plan.index, buffer, got, build, walk))


def _bucket_pieces(
    source: DTensorV2Source, rank: int
) -> tuple[Callable[[BucketPlan], list], list | None]:
    """This rank's pieces of each bucket in turn (buckets asked for in order), and, where
    they are the model's own tensors, the list they are taken from (`ShardPieces.listed`):
    only those copies are kept between syncs (converted or gathered pieces are new tensors
    every sync, and keeping them would hold their memory)."""
    pieces = ShardPieces(source, rank=rank)
    listed = pieces.listed()
    if listed is None:
        stream = iter(pieces)
        return (lambda plan: [next(stream) for _ in plan.tensors]), None
    at = [0]

    def take(plan: BucketPlan) -> list:
        start = at[0]
        at[0] = start + len(plan.tensors)
        return listed[start : at[0]]

    return take, listed


class _Kept(NamedTuple):
    """One bucket's kept copies (`_CopyLists`)."""

    where: tuple[int, int]  # the bucket buffer's (data pointer, size)
    datas: list  # the pieces' tensors (None: another rank's)
    names: list[str]
    offsets: list[int]
    lists: tuple[list, list]  # (big copies, small copy groups), as `_copy` takes them
    pointers: list[int]  # the pieces' data pointers
    to_graph: tuple[list, list] | None  # GPU (dsts, srcs) to capture at the next use
    walk: list | None  # the `ShardPieces.listed` list the pieces came from


class _CopyLists:
    """A rank's copies of each bucket (destinations in the bucket, sources in its shards),
    made once and kept while the bucket's buffer and every piece are the same as when they
    were made (the same tensor objects, which `ShardPieces` yields while the model's tensors
    stay where they are): a sync then copies each bucket with no Python work per tensor. On a
    GPU a kept list, the first time it is used again, is coalesced and captured into a CUDA
    graph (weightsync/gpu/copies.py, as the engine's loader does with a replayed bucket): one
    launch per bucket, each copy at the copy rate (many small tensors copied as bytes by
    `_foreach_copy_` run at a fraction of it)."""

    def __init__(self) -> None:
        self._lists: dict[int, _Kept] = {}

    def get(
        self,
        index: int,
        buffer: torch.Tensor,
        got: list[tuple[str, torch.Tensor | None, int]],
        build: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]],
        walk: list | None = None,
    ) -> tuple[list, list]:
        """The bucket's copies as `_split` gives them, made by `build` when not kept. `walk`:
        the `ShardPieces.listed` list `got` was taken from. That list is made again whenever
        a tensor of the model is replaced or its local memory moves (`ShardPieces._entries`
        compares every tensor's pointer each sync), so while it is the same list object as
        when the copies were made, and `got` the same part of it (as long, from the same
        first name), the pieces are too, at the same addresses, and are not compared again
        one by one."""
        where = (buffer.data_ptr(), buffer.numel())
        kept = self._lists.get(index)
        if (
            kept is not None
            and walk is not None
            and kept.walk is walk
            and kept.where == where
            and len(got) == len(kept.names)
            and (not got or got[0][0] == kept.names[0])
        ):
            return self._reuse(index, kept)
        datas = [g[1] for g in got]
        # Where each piece's memory is, too: `param.data = x` keeps the object and moves it.
        pointers = [0 if d is None else d.data_ptr() for d in datas]
        if (
            kept is not None
            and kept.where == where
            and len(kept.datas) == len(datas)
            and all(map(operator.is_, kept.datas, datas))
            and kept.pointers == pointers
            and kept.names == [g[0] for g in got]
            and kept.offsets == [g[2] for g in got]
        ):
            self._lists[index] = kept._replace(walk=walk)
            return self._reuse(index, self._lists[index])
        dsts, srcs = build()
        lists = _split(dsts, srcs)
        names, offsets = [g[0] for g in got], [g[2] for g in got]
        # Graphed only where every copy is within one GPU (a host source would synchronise,
        # which a capture refuses).
        cuda = bool(dsts) and dsts[0].is_cuda and all(s.device == dsts[0].device for s in srcs)
        self._lists[index] = _Kept(
            where, datas, names, offsets, lists, pointers, (dsts, srcs) if cuda else None, walk
        )
        return lists

    def _reuse(self, index: int, kept: _Kept) -> tuple[list, list]:
        """A kept bucket's copies, used again: on a GPU, as one graph from now on."""
        if kept.to_graph is None:
            return kept.lists
        try:
            lists = _graphed(*kept.to_graph)
        except RuntimeError:  # not capturable here: the plain copies, from now on
            lists = kept.lists
        self._lists[index] = kept._replace(lists=lists, to_graph=None)
        return lists

    def clear(self) -> None:
        self._lists.clear()


class BucketShardWriter:
    """Every rank copies its shard of each tensor into the shared bucket at its offset.

    Per bucket: rank 0 broadcasts the slot's handle once the engines are done with it (the other
    ranks wait for it: the slot is free), all ranks write, a barrier, then rank 0 hands the
    bucket to the engines."""

    def __init__(
        self,
        source: DTensorV2Source,
        group: SyncGroup,
        *,
        bucket_bytes: int,
    ) -> None:
        self.source = source
        self.group = group
        self.bucket_bytes = bucket_bytes
        # A test hook, set after construction (the reliability suite pauses rank 0 here).
        self.before_write: BeforeWrite | None = None
        self._maps: Any = None  # ranks > 0: the shared-memory slots they opened
        self._copies = _CopyLists()
        self._planned: tuple[Any, list[BucketPlan]] | None = None  # ranks > 0: (layout, plans)

    def sender_hook(self, transport: Any) -> Callable[[BucketPlan, int, torch.Tensor], None]:
        """Rank 0: the sender's `write_bucket` for one sync."""
        pieces, walk = _bucket_pieces(self.source, 0)
        kept = self._copies if walk is not None else None

        def write_bucket(plan: BucketPlan, slot: int, buffer: torch.Tensor) -> None:
            if self.before_write is not None:
                self.before_write("bucket", plan.index)
            self.group.broadcast(transport.handle(slot))
            _write_pieces(pieces(plan), plan, buffer, kept, walk)
            self.group.barrier()

        return write_bucket

    def follow(self) -> None:
        """Ranks > 0: write this rank's shards into every bucket of one sync."""
        from weightsync.transports.shm import ShmReceiver

        if self._maps is None:
            self._maps = ShmReceiver(max_open=4)
        pieces, walk = _bucket_pieces(self.source, self.group.rank)
        kept = self._copies if walk is not None else None
        for plan in self._plans():
            handle = self.group.broadcast()
            buffer = self._maps.receive(handle, plan.nbytes)
            _write_pieces(pieces(plan), plan, buffer, kept, walk)
            self.group.barrier()

    def _plans(self) -> list[BucketPlan]:
        """The buckets rank 0 sends, planned again only when the model's layout changed
        (`DTensorV2Source.layout` gives the same list while it has not): rank 0 plans once, at
        connect, and refuses a sync whose layout differs from that one."""
        layout = self.source.layout()
        if self._planned is None or self._planned[0] is not layout:
            plans = plan_buckets(self.source.specs(), capacity_bytes=self.bucket_bytes)
            self._planned = (layout, plans)
        return self._planned[1]

    def close(self) -> None:
        self._copies.clear()
        if self._maps is not None:
            self._maps.close()
            self._maps = None


# (name, data or None, byte offset inside the full tensor): what `ShardPieces` yields.
Pieces = Iterator[tuple[str, torch.Tensor | None, int]]


class _GatherLayout(NamedTuple):
    """What the ranks' bucket gathers move: the same every sync (the model's sharding)."""

    plans: list[BucketPlan]
    extents: list[list[tuple[str, int, int]]]  # per bucket: this rank's (name, nbytes, offset)
    shares: list[int]  # per bucket: the bytes each rank > 0 sends (its largest part; 0: none)
    # Rank 0, per bucket: (bucket offset, offset in the receive buffer, nbytes) of every run of
    # the ranks > 0; rank r's part starts at r * share.
    runs: list[list[tuple[int, int, int]]]
    group: Any  # the sync group it was learned in (a rebuilt group learns it again)


def _learn_layout(source: DTensorV2Source, group: SyncGroup, *, bucket_bytes: int) -> _GatherLayout:
    """Every rank: where its pieces of each bucket go, from the sharding alone (no tensor is
    gathered); rank 0 learns every rank's runs. Collective (a gather and a broadcast)."""
    plans = plan_buckets(source.specs(), capacity_bytes=bucket_bytes)
    stream = ShardPieces(source, rank=group.rank).extents()
    extents: list[list[tuple[str, int, int]]] = []
    mine: list[list[list[int]]] = []  # per bucket: [bucket offset, nbytes] of each run
    for plan in plans:
        bucket: list[tuple[str, int, int]] = []
        runs: list[list[int]] = []
        for meta in plan.tensors:
            extent = next(stream, None)
            if extent is None or extent[0] != meta.name:
                raise RuntimeError(
                    f"shard stream gave {None if extent is None else extent[0]!r} where the "
                    f"bucket plan has {meta.name!r}: the model changed since refit info was taken"
                )
            bucket.append(extent)
            _, nbytes, offset = extent
            if nbytes:
                start = meta.offset + offset
                if runs and runs[-1][0] + runs[-1][1] == start:
                    runs[-1][1] += nbytes  # back to back in the bucket and in the packed buffer
                else:
                    runs.append([start, nbytes])
        extents.append(bucket)
        mine.append(runs)
    everyone = group.gather(mine)
    shares: list[int] | None = None
    received: list[list[tuple[int, int, int]]] = [[] for _ in plans]
    if everyone is not None:  # rank 0
        shares = [
            max((sum(n for _, n in rank_runs[b]) for rank_runs in everyone[1:]), default=0)
            for b in range(len(plans))
        ]
        for b, share in enumerate(shares):
            for rank in range(1, len(everyone)):
                at = rank * share
                for start, nbytes in everyone[rank][b]:
                    received[b].append((start, at, nbytes))
                    at += nbytes
    shares = group.broadcast(shares)
    return _GatherLayout(plans, extents, shares, received, group.group)


def _copies(
    pieces: Pieces,
    plan: BucketPlan,
    extents: list[tuple[str, int, int]],
    buffer: torch.Tensor,
    *,
    packed: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destinations, sources) of this rank's pieces of `plan`'s tensors: into the bucket at
    their offsets, or (`packed`) back to back from the start of `buffer`."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    at = 0
    for meta, extent in zip(plan.tensors, extents):
        name, data, offset = next(pieces)
        nbytes = 0 if data is None else data.numel() * data.element_size()
        if (name, nbytes, offset) != extent:
            raise RuntimeError(
                f"tensor {name!r}: this rank holds {nbytes} bytes at offset {offset}, where the "
                f"bucket plan of the first sync has {extent[0]!r} with {extent[1]} bytes at "
                f"{extent[2]}: the model changed since refit info was taken"
            )
        if data is None or not nbytes:
            continue
        start = at if packed else meta.offset + offset
        dsts.append(buffer[start : start + nbytes])
        srcs.append(data.reshape(-1).view(torch.uint8))
        at += nbytes
    return dsts, srcs


def _split(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list, list]:
    """Byte copies as few calls: the large alone (a single copy runs at the copy engine's
    rate), the rest in one `_foreach_copy_`: ([(dst, src)], [(dsts, srcs)])."""
    big, small = [], ([], [])  # type: ignore[var-annotated]
    for dst, src in zip(dsts, srcs):
        if dst.numel() >= ONE_COPY_BYTES:
            big.append((dst, src))
        else:
            small[0].append(dst)
            small[1].append(src)
    return big, [small]


def _graphed(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list, list]:
    """GPU byte copies kept for reuse: coalesced where both sides lie back to back, then
    captured into one CUDA graph (`copies.GRAPHS`), as `_copy` takes them."""
    big, small = copies.coalesce(list(zip(dsts, srcs)))
    if not copies.GRAPHS:
        return big, small
    return [(copies.capture(big, small, dsts[0].device), None)], []


def _copy(big: list, small: list) -> None:
    copies.issue(big, small)


class BucketGatherWriter:
    """Rank 0 fills each bucket from every rank's shards with one gather per bucket.

    For transports whose bucket only rank 0 can write (cuda_ipc, gloo, nccl). Per bucket: every
    rank packs its own shard bytes of the bucket's tensors back to back into a buffer the size of
    the largest rank's part; rank 0 copies its own pieces into the bucket, one gather
    (`SyncGroup.gather_into`) brings the other ranks' buffers to it, and it copies their runs to
    their offsets (one copy per run: a rank's pieces of adjacent tensors are one run). Tensors
    that are not dim-0 shards (tensor parallel, converted by an adapter) are still gathered one
    at a time by `ShardPieces` and written by rank 0; replicated ones are written by rank 0.
    Which rank sends which bytes is learned once, at the first sync (a gather of each rank's
    runs); each sync checks every piece against it. Rank 0 holds a receive buffer of about one
    bucket during a sync, the other ranks one of their part of a bucket."""

    def __init__(
        self,
        source: DTensorV2Source,
        group: SyncGroup,
        *,
        bucket_bytes: int,
    ) -> None:
        self.source = source
        self.group = group
        self.bucket_bytes = bucket_bytes
        # A test hook, set after construction (the reliability suite pauses rank 0 here).
        self.before_write: BeforeWrite | None = None
        self._layout: _GatherLayout | None = None
        self._copies = _CopyLists()  # rank 0: its own pieces into each bucket

    def _layout_now(self) -> _GatherLayout:
        """Every rank, at the start of a sync: the layout, learned at the first sync and again
        after a failed sync rebuilt the sync group (all ranks do so together)."""
        layout = self._layout
        if layout is None or layout.group is not self.group.group:
            layout = self._layout = _learn_layout(
                self.source, self.group, bucket_bytes=self.bucket_bytes
            )
        return layout

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A receive or send buffer on the model's device."""
        param = next(self.source.model.parameters(), None)
        device = torch.device("cpu") if param is None else param.device
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def sender_hook(self, transport: Any) -> Callable[[BucketPlan, int, torch.Tensor], None]:
        """Rank 0: the sender's `write_bucket` for one sync (`transport` is unused: the bucket
        is rank 0's own)."""
        layout = self._layout_now()
        world_size = self.group.world_size
        received = self._buffer(world_size * max(layout.shares, default=0))
        pieces, walk = _bucket_pieces(self.source, 0)

        def write_bucket(plan: BucketPlan, slot: int, buffer: torch.Tensor) -> None:
            if self.before_write is not None:
                self.before_write("bucket", plan.index)
            got = pieces(plan)
            extents = layout.extents[plan.index]

            def build() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
                return _copies(iter(got), plan, extents, buffer, packed=False)

            if walk is None:
                _copy(*_split(*build()))
            else:
                _copy(*self._copies.get(plan.index, buffer, got, build, walk))
            share = layout.shares[plan.index]
            if not share:  # every byte of the bucket is rank 0's
                return
            parts = received[: world_size * share].view(world_size, share)
            self.group.gather_into(parts[0], list(parts.unbind(0)))
            runs = layout.runs[plan.index]
            _copy(
                *_split(
                    [buffer[start : start + n] for start, _, n in runs],
                    [received[at : at + n] for _, at, n in runs],
                )
            )

        return write_bucket

    def follow(self) -> None:
        """Ranks > 0: send this rank's shards of every bucket of one sync to rank 0."""
        layout = self._layout_now()
        send = self._buffer(max(layout.shares, default=0))
        pieces = iter(ShardPieces(self.source, rank=self.group.rank))
        for plan, extents, share in zip(layout.plans, layout.extents, layout.shares):
            _copy(*_split(*_copies(pieces, plan, extents, send, packed=True)))
            if share:
                self.group.gather_into(send[:share], None)

    def close(self) -> None:
        self._layout = None
        self._copies.clear()
