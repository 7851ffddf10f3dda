"""A point-to-point transport: every trainer rank sends its own shards' pieces straight to the
engine workers that keep them, as a transfer plan says (weightsync/wire/transfer_plan.py).

One process group of all trainer ranks (group ranks 0..T-1, each its trainer rank) and all
engine workers (T + the worker's index in the plan), gloo on CPU, NCCL on GPU, built from a
TCPStore that trainer rank 0 hosts (it only hosts the rendezvous: no byte of another rank passes
through it). A sync is one message per link of the plan: a rank packs the pieces it sends a
worker, in the plan's order, each at an 8-byte boundary, into one buffer and sends it; the worker
receives one buffer from each rank it has a link with, all at once, and copies each piece to its
place in the parameter (the move's destination pattern). The buffers and every piece's views are
made once (while the shards and parameters are the same tensors), so a sync's packing and
writing are one batched copy on each side. Each side counts what it sent and
received, so tests can see that no rank sent more than its own pieces.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from weightsync.transports.collective import _failing_as, _make_group
from weightsync.transports.rendezvous import host_store
from weightsync.wire.fingerprint import (
    Fingerprint,
    FingerprintBatch,
    placed,
    shift,
    words_per_element,
)
from weightsync.wire.placement import pattern_view
from weightsync.wire.specs import align
from weightsync.wire.transfer_plan import Move, TransferPlan

logger = logging.getLogger(__name__)

_ALIGN = 8


def _layout(plan: TransferPlan, moves: list[Move]) -> tuple[list[int], int, int]:
    """Byte offset of each move's piece in a link's buffer, the buffer's size, and the bytes
    of the pieces alone (the size less the padding)."""
    offsets, at, payload = [], 0, 0
    for move in moves:
        offsets.append(at)
        nbytes = move[3] * move[4] * plan.element_bytes[move[0]]
        at += align(nbytes, _ALIGN)
        payload += nbytes
    return offsets, at, payload


def _check(name: str, tensor: torch.Tensor, plan: TransferPlan, what: str) -> None:
    """A shard or parameter the views can be made over: contiguous (a view of a copy would be
    read or written instead of it) and of the element size the plan laid the buffers out for."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor {name!r}: the {what} is not contiguous; pass a contiguous one (the "
            "point-to-point path reads and writes it in place)"
        )
    if tensor.element_size() != plan.element_bytes[name]:
        raise ValueError(
            f"tensor {name!r}: the {what} has {tensor.element_size()}-byte elements ("
            f"{tensor.dtype}) but the plan was made for {plan.element_bytes[name]}-byte ones; "
            "make the plan with the dtype that is sent"
        )


class _Member:
    """One process of the group: trainer rank `rank` or engine worker `worker`."""

    def __init__(
        self,
        plan: TransferPlan,
        group_rank: int,
        *,
        host: str,
        port: int | None,
        backend: str,
        timeout_s: float,
    ) -> None:
        self.plan = plan
        self.group_rank = group_rank
        self.world_size = plan.num_ranks + plan.num_workers
        self.backend = backend
        self.host = host
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else (torch.device("cpu"))
        )
        if group_rank == 0:
            self.store = host_store(host, timeout_s=timeout_s, world_size=self.world_size)
        else:
            if port is None:
                raise ValueError("port=None: every member but trainer rank 0 needs its port")
            self.store = dist.TCPStore(
                host, port, self.world_size, is_master=False, timeout=self.timeout
            )
        self.port = self.store.port
        self.group: Any = None
        self.num_syncs = 0

    def _join(self) -> None:
        if self.group is not None:
            return
        with _failing_as(
            f"point-to-point member {self.group_rank}: the {self.world_size} processes of the "
            f"{self.backend} group at {self.host}:{self.port} did not all join within "
            f"{self.timeout.total_seconds():g} s",
            "Is every trainer rank and engine worker alive and reaching that address?",
        ):
            self.group = _make_group(
                self.backend, self.store, self.group_rank, self.world_size, self.timeout, self.host
            )

    def _wait(self, works: list[tuple[Any, str]]) -> None:
        for work, peer in works:
            with _failing_as(
                f"point-to-point member {self.group_rank}: the message with {peer} did not "
                f"complete within {self.timeout.total_seconds():g} s",
                "Is that peer alive? A slow one needs a larger timeout_s.",
            ):
                work.wait()

    def close(self) -> None:
        self.group = None
        self.store = None  # type: ignore[assignment]


class PointToPointSender(_Member):
    """Trainer rank `rank`'s side. Collective over the group: every trainer rank and every
    worker of the plan calls its `send` / `receive` once a sync."""

    def __init__(
        self,
        plan: TransferPlan,
        rank: int,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(plan, rank, host=host, port=port, backend=backend, timeout_s=timeout_s)
        self.rank = rank
        self.links = {w: (moves, *_layout(plan, moves)) for w, moves in plan.sends(rank).items()}
        self._buffers = {
            w: torch.empty(max(link[2], 1), dtype=torch.uint8, device=self.device)
            for w, link in self.links.items()
        }
        self._copies: tuple[tuple, list[torch.Tensor], list[torch.Tensor]] | None = None

    def send(self, shards: Mapping[str, tuple[int, torch.Tensor]]) -> dict[int, int]:
        """Send this rank's pieces. `shards`: {tensor: (first element, the elements this rank
        holds from there, flat)}. Returns {worker: bytes of the pieces sent}."""
        self._join()
        self.num_syncs += 1
        key = tuple((n, s, t.data_ptr(), t.numel(), t.dtype) for n, (s, t) in shards.items())
        if self._copies is None or self._copies[0] != key:
            self._copies = (key, *self._views(shards))
        if self._copies[1]:  # a rank the plan gives nothing still takes part
            with torch.no_grad():
                torch._foreach_copy_(self._copies[1], self._copies[2])
        works, sent = [], {}
        for worker, (_, _, _, payload) in self.links.items():
            peer = self.plan.num_ranks + worker
            buf = self._buffers[worker]
            works.append((self.group.send([buf], peer, self.num_syncs), f"worker {worker}"))
            sent[worker] = payload
        self._wait(works)
        return sent

    def sent_prints(self) -> list[tuple[int, str, Fingerprint]]:
        """After `send`: (worker, tensor, contribution) of every piece sent, hashed from the
        shard's elements the plan names (so a piece taken from the wrong elements fails the
        check too), each where it lands in the worker's parameter (weightsync/wire/
        fingerprint.py `placed`): summed over every rank's pieces of a parameter (`combine`),
        what the worker's parameter must fingerprint to. Each rank hashes only its own."""
        if self._copies is None:
            raise RuntimeError(f"rank {self.rank}: sent_prints before send")
        views = iter(self._copies[2])
        batch = FingerprintBatch()
        whole: list[tuple[int, int, int]] = []  # (its place in out, its batch index, shift)
        out: list[tuple[int, str, Fingerprint]] = []
        for worker, (moves, _, _, _) in self.links.items():
            for move in moves:
                view = next(views)
                if move[4] == 1:  # one run: hashed with the others, shifted to its place
                    whole.append(
                        (len(out), batch.add(view), move[1] * words_per_element(view.dtype))
                    )
                    out.append((worker, move[0], (0, 0, 0)))
                else:
                    out.append((worker, move[0], placed(view, move[1], move[5])))
        read = batch.read()
        for at, index, words in whole:
            worker, name, _ = out[at]
            out[at] = (worker, name, shift(read[index], words))
        return out

    def _views(
        self, shards: Mapping[str, tuple[int, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each piece's place in its link's buffer and its elements in the shard, made once
        for as long as the shards are the same tensors: a sync is then one batched copy."""
        dsts, srcs = [], []
        for worker, (moves, offsets, _, _) in self.links.items():
            buf = self._buffers[worker]
            for move, at in zip(moves, offsets):
                start, flat = shards[move[0]]
                _check(move[0], flat, self.plan, "shard")
                local = [move[1], move[2] - start, *move[3:]]
                nbytes = move[3] * move[4] * flat.element_size()
                dsts.append(buf[at : at + nbytes].view(flat.dtype).view(move[4], move[3]))
                srcs.append(pattern_view(flat.view(-1), local))
        return dsts, srcs


class PointToPointReceiver(_Member):
    """Engine worker `worker`'s side: receives from every rank it has a link with and writes
    each piece into its parameter."""

    def __init__(
        self,
        plan: TransferPlan,
        worker: int,
        *,
        host: str = "127.0.0.1",
        port: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(
            plan,
            plan.num_ranks + worker,
            host=host,
            port=port,
            backend=backend,
            timeout_s=timeout_s,
        )
        self.worker = worker
        self.links = {
            r: (moves, *_layout(plan, moves)) for r, moves in plan.receives(worker).items()
        }
        self._buffers = {
            r: torch.empty(max(link[2], 1), dtype=torch.uint8, device=self.device)
            for r, link in self.links.items()
        }
        self._copies: tuple[tuple, list[torch.Tensor], list[torch.Tensor]] | None = None

    def receive(self, params: Mapping[str, torch.Tensor]) -> dict[int, int]:
        """Receive this worker's pieces into `params` ({tensor: the flat parameter it is placed
        in}). Returns {rank: bytes of the pieces received}."""
        got = self.receive_buffers()
        self.write(params)
        return got

    def receive_buffers(self) -> dict[int, int]:
        """The first half of `receive`: every linked rank's buffer received, nothing written
        yet. Returns {rank: bytes of the pieces received}."""
        self._join()
        self.num_syncs += 1
        works, got = [], {}
        for rank, (_, _, _, payload) in self.links.items():
            buf = self._buffers[rank]
            works.append((self.group.recv([buf], rank, self.num_syncs), f"trainer rank {rank}"))
            got[rank] = payload
        self._wait(works)
        return got

    def write(self, params: Mapping[str, torch.Tensor]) -> None:
        """The second half of `receive`: each received piece copied to its place."""
        key = tuple((n, p.data_ptr(), p.numel(), p.dtype) for n, p in params.items())
        if self._copies is None or self._copies[0] != key:
            self._copies = (key, *self._views(params))
        if self._copies[1]:
            with torch.no_grad():
                torch._foreach_copy_(self._copies[1], self._copies[2])

    def _views(
        self, params: Mapping[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each piece's place in its parameter and in its link's buffer, made once for as long
        as the parameters are the same tensors."""
        dsts, srcs = [], []
        for rank, (moves, offsets, _, _) in self.links.items():
            buf = self._buffers[rank]
            for move, at in zip(moves, offsets):
                param = params[move[0]]
                _check(move[0], param, self.plan, "parameter")
                nbytes = move[3] * move[4] * param.element_size()
                srcs.append(buf[at : at + nbytes].view(param.dtype).view(move[4], move[3]))
                dsts.append(pattern_view(param.view(-1), move[1:], dst=True))
        return dsts, srcs
