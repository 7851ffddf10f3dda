"""The trainer ranks' own side channel for a sync: handles, plans and barriers.

A sync needs a few small collectives among the trainer ranks (rank 0 tells the others which
engines take which path and where the shared bytes are; the ranks report back what they
wrote), as JSON (never pickle); the bucket gather's raw shard bytes go through `gather_into`.
They run in a gloo group of their own, bounded by the sync's timeout: a rank that dies
mid-sync fails the others within it, whatever timeout the training collectives have, and a
hung sync never blocks the training group.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

# Each gloo group's last barrier, kept until the interpreter exits: see `leave_group`.
_last_barriers: list[dist.Work] = []
# Groups a failed sync left out of step, replaced by `SyncGroup.recover`: never used again, never
# destroyed (their worker threads may still hold a collective), released at exit.
_abandoned: list[dist.ProcessGroup] = []


def leave_group(group: dist.ProcessGroup | None = None) -> None:
    """A last barrier in `group` (default: the whole world), whose handle is kept until the
    interpreter exits, so that the process can exit cleanly. Every rank of the group calls it
    after its last collective there; the caller then destroys the group.

    Why: a gloo worker thread drops a finished collective after the caller has seen it complete,
    and dropping its tensors takes the GIL (torch keeps their Python objects alive while C++
    holds them). On a loaded machine the worker can get there just as Python starts finalizing;
    Python 3.11 ends a thread that then waits for the GIL with pthread_exit, whose unwind
    through the collective's destructor aborts the process ("terminate called without an active
    exception", SIGABRT in thread `pt_gloo_runloop`). `destroy_process_group` does not stop
    these threads: the backend lives on while any DeviceMesh or DTensor refers to it. A gloo
    barrier records, under the lock the workers drop their collectives under, every collective
    not dropped yet, and a collective's tensors are freed only when the last such record goes.
    Kept in a module global, the barrier goes only once Python has finalized so far that torch
    no longer takes the GIL to drop a Python object (it leaks it).
    """
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    if dist.get_backend(group) == "gloo":
        _last_barriers.append(work)


def abandoned(group: dist.ProcessGroup) -> bool:
    """Whether `SyncGroup.recover` replaced `group` (no collective may run in it any more)."""
    return any(group is g for g in _abandoned)


def _encode(obj: Any) -> bytes:
    """JSON, never pickle: a rank reads nothing from its peers but plain data."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


def _new_group(ranks: list[int] | None, timeout: datetime.timedelta) -> dist.ProcessGroup | None:
    """A gloo group of `ranks` (None: the world). Collective: every process of the world calls
    it; a process outside `ranks` gets None (torch's NON_GROUP_MEMBER)."""
    group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    return group if isinstance(group, dist.ProcessGroup) else None


def _to_tensor(data: bytes, size: int) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


class SyncGroup:
    """The sync's collectives over the ranks of `group` (default: the whole world).

    Built on every process of the default group at once (`dist.new_group` is collective), like
    the model it serves. Rank numbers are ranks inside `group`."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout_s: float) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "dist.init_process_group (or init_trainer_group) first"
            )
        self._parent = group
        self._ranks = dist.get_process_group_ranks(group) if group is not None else None
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._group = _new_group(self._ranks, self._timeout)
        # -1 on a process outside the group, as torch numbers it there
        self.rank = -1 if self._group is None else dist.get_rank(self._group)
        self.world_size = -1 if self._group is None else dist.get_world_size(self._group)
        self.failed = False  # set by the caller when a sync raised on this rank

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group the sync's collectives run in (this process must be one of its
        ranks)."""
        if self._group is None:
            raise RuntimeError(
                f"global rank {dist.get_rank()} is not one of the sync group's ranks "
                f"{self._ranks}: only the ranks that hold the model take part in a sync"
            )
        return self._group

    def recover(self) -> bool:
        """Every rank, before a sync: if the last sync failed on any rank, replace the group by
        a fresh one; whether it did. A failed sync leaves a gloo group out of step: one rank
        left it early while the others waited in a collective until the timeout, or one rank's
        failure came after the others' last collective. The ranks agree on it over the group
        the trainer was built on (the training group), which the failure did not touch."""
        on_gpu = dist.get_backend(self._parent) == "nccl"
        flag = torch.tensor(
            [int(self.failed)], device=torch.cuda.current_device() if on_gpu else "cpu"
        )
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._parent)
            failed = int(flag.item())  # where NCCL's wait surfaces
        except RuntimeError as exc:
            first = (str(exc).splitlines() or [""])[0][:300]
            raise RuntimeError(
                f"trainer rank {dist.get_rank()}: the ranks did not all begin this sync within "
                f"the training group's timeout (one still in its previous call, or gone): "
                f"every rank must call sync() together. {first}"
            ) from exc
        self.failed = False
        if not failed:
            return False
        _abandoned.append(self.group)
        self._group = _new_group(self._ranks, self._timeout)
        return True

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (plain data: JSON types), on every rank. A value JSON cannot spell
        raises TypeError on rank 0 and RuntimeError on the others."""
        if self.world_size == 1:  # nothing to send (as JSON all the same)
            try:
                return json.loads(_encode(obj))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"sync group: {exc}") from exc
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        error = None
        if self.rank == 0:
            try:
                data = _encode(obj)
                size[0] = len(data)
            except (TypeError, ValueError) as exc:
                error, size[0] = exc, -1
        dist.broadcast(size, group=self.group, group_src=0)
        if int(size[0]) < 0:
            if error is not None:
                raise TypeError(f"sync group: {error}") from error
            raise RuntimeError("sync group: rank 0 could not encode what it broadcast")
        buf = (
            _to_tensor(data, int(size[0]))
            if self.rank == 0
            else torch.empty(int(size[0]), dtype=torch.uint8)
        )
        dist.broadcast(buf, group=self.group, group_src=0)
        return json.loads(buf.numpy().tobytes()) if self.rank != 0 else json.loads(data)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (plain data), in rank order, on rank 0; None elsewhere."""
        data = _encode(obj)
        if self.world_size == 1:
            return [json.loads(data)]
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s[0]) for s in sizes)
        buf = _to_tensor(data, longest)
        out = (
            [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            if self.rank == 0
            else None
        )
        dist.gather(buf, out, group=self.group, group_dst=0)
        if out is None:
            return None
        return [json.loads(b[: int(s[0])].numpy().tobytes()) for b, s in zip(out, sizes)]

    def gather_into(self, tensor: torch.Tensor, out: list[torch.Tensor] | None) -> None:
        """Every rank's `tensor` (the same size on each) into rank 0's `out` (one tensor per
        rank, in rank order; None on the other ranks): a sync's bulk bytes. CPU tensors go
        through this group, bounded by the sync's timeout; GPU tensors through the group the
        trainer was built on (NCCL: gloo gathers no GPU memory), under its own timeout."""
        if tensor.device.type == "cpu":
            dist.gather(tensor, out, group=self.group, group_dst=0)
            return
        if dist.get_rank(self._parent) != self.rank:
            raise RuntimeError(
                f"sync group rank {self.rank} is rank {dist.get_rank(self._parent)} of the "
                f"trainer's group: GPU bytes gathered there would land in another rank's place; "
                f"build the trainer's group with its ranks in ascending order"
            )
        dist.gather(tensor, out, group=self._parent, group_dst=0)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """All ranks of the group call it (a process outside the group has nothing to close)."""
        if dist.is_initialized() and self._group is not None:
            leave_group(self._group)
            dist.destroy_process_group(self._group)
