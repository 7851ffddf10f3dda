"""Trainer ranks writing their own FSDP2 shards, on the two shared-memory paths.

FSDP2 shards every tensor along dim 0, so a rank's shard is one contiguous byte range of the
full tensor (`ShardPieces`): each rank can copy its own range to its place, with no all-gather.
  - `BucketShardWriter`: into the shared-memory bucket the sender is about to hand the engines.
  - `OneCopyWriter`: straight into the engines' shared parameters (weightsync/trainer/one_copy/targets.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.trainer.sync_group import SyncGroup
from weightsync.wire.bucket import BucketPlan, plan_buckets

# Called on rank 0 before it writes bucket or piece `index`: ("bucket" | "piece", index). The
# reliability tests set it on the writers after construction (the worker's
# `pause_before_write`) and pause there to kill a process mid-sync.
BeforeWrite = Callable[[str, int], None]


def _write_pieces(pieces: Any, plan: BucketPlan, buffer: torch.Tensor) -> None:
    for meta in plan.tensors:
        name, data, offset = next(pieces)
        if name != meta.name:
            raise RuntimeError(
                f"shard stream gave {name!r} where the bucket plan has "
                f"{meta.name!r}: the model changed since refit info was taken"
            )
        if data is not None:
            start = meta.offset + offset
            buffer[start : start + data.nbytes].copy_(data.reshape(-1).view(torch.uint8))


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

    def sender_hook(self, transport: Any) -> Callable[[BucketPlan, int, torch.Tensor], None]:
        """Rank 0: the sender's `write_bucket` for one sync."""
        pieces = iter(ShardPieces(self.source, rank=0))

        def write_bucket(plan: BucketPlan, slot: int, buffer: torch.Tensor) -> None:
            if self.before_write is not None:
                self.before_write("bucket", plan.index)
            self.group.broadcast(transport.handle(slot))
            _write_pieces(pieces, plan, buffer)
            self.group.barrier()

        return write_bucket

    def follow(self) -> None:
        """Ranks > 0: write this rank's shards into every bucket of one sync."""
        from weightsync.transports.shm import ShmReceiver

        if self._maps is None:
            self._maps = ShmReceiver(max_open=4)
        pieces = iter(ShardPieces(self.source, rank=self.group.rank))
        for plan in plan_buckets(self.source.specs(), capacity_bytes=self.bucket_bytes):
            handle = self.group.broadcast()
            _write_pieces(pieces, plan, self._maps.receive(handle, plan.nbytes))
            self.group.barrier()

    def close(self) -> None:
        if self._maps is not None:
            self._maps.close()
            self._maps = None
