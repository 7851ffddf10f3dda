"""Trainer ranks writing their own FSDP2 shards, on the two shared-memory paths.

FSDP2 shards every tensor along dim 0, so a rank's shard is one contiguous byte range of the
full tensor (`ShardPieces`): each rank can copy its own range to its place, with no all-gather.
  - `BucketShardWriter`: into the shared-memory bucket the sender is about to hand the engines.
  - `OneCopyWriter`: straight into the engines' shared parameters (weightsync/trainer/one_copy/targets.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.wire.bucket import BucketPlan, plan_buckets
from weightsync.trainer.one_copy.targets import DirectTarget
from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.trainer.sync_group import SyncGroup
from weightsync.trainer.one_copy.writer import WritePlan, same_targets

logger = logging.getLogger(__name__)

# Called on rank 0 before it writes bucket or piece `index`: ("bucket" | "piece", index). The
# reliability tests pause here to kill a process mid-sync.
BeforeWrite = Callable[[str, int], None]


def _write_pieces(pieces: Any, plan: BucketPlan, buffer: torch.Tensor) -> None:
    for meta in plan.tensors:
        name, data, offset = next(pieces)
        if name != meta.name:
            raise RuntimeError(f"shard stream gave {name!r} where the bucket plan has "
                               f"{meta.name!r}: the model changed since refit info was taken")
        if data is not None:
            start = meta.offset + offset
            buffer[start:start + data.nbytes].copy_(data.reshape(-1).view(torch.uint8))


class BucketShardWriter:
    """Every rank copies its shard of each tensor into the shared bucket at its offset.

    Per bucket: rank 0 broadcasts the slot's handle once the engines are done with it (the other
    ranks wait for it: the slot is free), all ranks write, a barrier, then rank 0 hands the
    bucket to the engines."""

    def __init__(self, source: DTensorV2Source, group: SyncGroup, *, bucket_bytes: int,
                 before_write: BeforeWrite | None = None) -> None:
        self.source = source
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.before_write = before_write
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


def worker_shares(shared: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An engine's `share_params()["shared"]`: one worker's description, or a list of them (a
    tensor-parallel engine's, each worker's slices in its own segment)."""
    return shared if isinstance(shared, list) else [shared]


class _PieceByPiece:
    """A write plan's stand-in for a model whose state dict cannot be planned."""

    def __init__(self, writer: OneCopyWriter, targets: list[DirectTarget]) -> None:
        self.writer, self.targets = writer, targets

    def holds(self, targets: list[DirectTarget]) -> bool:
        return same_targets(targets, self.targets)

    checks = True  # verifies piece by piece itself

    def write(self, *, verify: bool = False) -> tuple[int, set[str]]:
        return self.writer._write_each(self.targets, None, verify=verify)


class OneCopyWriter:
    """Every rank writes its own shards into the shared parameters of the engines it is told
    of, reading each chunk back when verifying (weightsync/trainer/one_copy/targets.py)."""

    def __init__(self, source: DTensorV2Source, group: SyncGroup, *,
                 before_write: BeforeWrite | None = None) -> None:
        self.source = source
        self.group = group
        self.before_write = before_write
        self.targets: dict[str, list[DirectTarget]] = {}  # engine -> each worker's parameters
        self.rank_write_s: list[float] = []  # rank 0: each rank's seconds in the last write
        self.plan: Any = None  # WritePlan of the last planned write

    def write(self, msg: dict[str, Any], *, verify: bool) -> dict[str, Any] | None:
        """Every rank, with rank 0's `msg` {"direct": engines, "new": {engine: shared}}.

        Returns on rank 0 how many pieces and bytes (into all engines' workers) were written and
        which tensors' bytes read back differently; None elsewhere."""
        for name in msg.get("fallback", ()):  # its parameters moved: let go of them
            self.forget(name)
        for name, shared in msg["new"].items():
            self.forget(name)
            self.targets[name] = [DirectTarget(s) for s in worker_shares(shared)]
        targets = [t for n in msg["direct"] for t in self.targets[n]]
        written_before = sum(t.written for t in targets)
        start = time.perf_counter()
        hook = self.before_write if self.group.rank == 0 else None
        # Without autograd a DTensor's to_local() is its local tensor, not an autograd call:
        # ~5 us less per tensor, which counts with thousands of them (MoE experts).
        with torch.no_grad():
            # Verified writes go through the plan only on GPUs (one fused copy-and-read-back
            # kernel, weightsync/gpu/kernel.py); on the CPU piece by piece, read back in cache.
            plan = None
            if hook is None and targets and self._replays(targets, verify=verify):
                pieces, mismatched = self._write_then_check(targets, verify=verify)
            else:
                if hook is None and targets and (
                        not verify or all(t.device is not None for t in targets)):
                    plan = self._planned(targets)
                if plan is None or (verify and not plan.checks):
                    pieces, mismatched = self._write_each(targets, hook, verify=verify)
                else:
                    pieces, mismatched = plan.write(verify=verify)
            for target in targets:  # GPU copies are asynchronous: landed before we answer
                target.flush()
        seconds = time.perf_counter() - start
        nbytes = sum(t.written for t in targets) - written_before
        gathered = self.group.gather((pieces, sorted(mismatched), seconds, nbytes))
        if gathered is None:
            return None
        self.rank_write_s = [g[2] for g in gathered]
        return {"pieces": sum(g[0] for g in gathered),
                "mismatched": sorted({m for g in gathered for m in g[1]}),
                "bytes": sum(g[3] for g in gathered)}

    def _replays(self, targets: list[DirectTarget], *, verify: bool) -> bool:
        """Whether the last plan copies into `targets` (the same objects), cuts nothing per
        sync (gathered tensors, a collective every rank must take once, and those it could not
        plan) and, with `verify`, verifies its copies itself (GPU targets): then its copies are
        issued before the plan is checked (`_write_then_check`)."""
        plan = self.plan
        return (isinstance(plan, WritePlan) and not plan.each_sync
                and (plan.checks or not verify) and same_targets(targets, plan.targets))

    def _write_then_check(self, targets: list[DirectTarget], *,
                          verify: bool) -> tuple[int, set[str]]:
        """Issue the plan's copies (verified: its copy-and-read-back kernels), then check the
        plan: on a GPU while they run (with thousands of tensors the check takes a good part of
        the copying's time). The copies read only the sources planned, which the plan keeps
        alive, so a stale plan costs a wasted copy, never a read of freed memory: should the
        model have changed, wait for those copies, plan again and write (and verify) once
        more, all before the engines' `end`. (A storage freed
        in place, `untyped_storage().resize_(0)`, is not kept alive by its views; FSDP2 does
        that to unsharded parameters only, never to the sharded ones the plan reads.)"""
        written = [t.written for t in targets]
        plan = self.plan
        launched = plan.launch(verify=verify)
        if plan.holds(targets):
            return plan.count, plan.landed(launched)
        plan.landed(launched)  # a wasted copy: wait for it, forget what it read back
        for target, before in zip(targets, written):
            target.flush()
            target.written = before
        return self._planned(targets).write(verify=verify)

    def _planned(self, targets: list[DirectTarget]) -> Any:
        """This rank's write plan into `targets`, made again when the model's parameters or
        the targets changed; piece by piece where the model cannot be planned."""
        if self.plan is None or not self.plan.holds(targets):
            pieces = ShardPieces(self.source, rank=self.group.rank)
            self.plan = WritePlan.build(pieces, targets) or _PieceByPiece(self, targets)
        return self.plan

    def _write_each(self, targets: list[DirectTarget], hook: BeforeWrite | None, *,
                    verify: bool) -> tuple[int, set[str]]:
        """Cut and write every piece (reading each back with `verify`); (pieces, mismatched)."""
        pieces, mismatched = 0, set()
        for index, (name, data, offset) in enumerate(
                ShardPieces(self.source, rank=self.group.rank) if targets else ()):
            if hook is not None:
                hook("piece", index)
            if data is None:
                continue
            raw = data.reshape(-1).view(torch.uint8)
            for target in targets:
                if not target.write(name, offset, raw, check=verify):
                    mismatched.add(name)
            pieces += 1
        return pieces, mismatched

    def forget(self, name: str) -> None:
        self.plan = None  # its views point into the targets' segments
        for target in self.targets.pop(name, []):
            target.close()

    def close(self) -> None:
        for name in list(self.targets):
            self.forget(name)
