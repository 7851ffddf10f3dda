"""An engine worker's end of the point-to-point path (weightsync/transports/p2p.py): the trainer's
ranks send each worker the pieces of their own shards that it keeps, and the worker writes each
piece straight to its place in its parameter, as its own loader would (the placements it
learned from that loader, weightsync/wire/placement.py).

Runs next to the engine's model, one per worker, over the worker's `ModelReceiver`: `open` takes
the transfer plan (plain data) and checks, before anything is written, that every parameter the
plan writes is one the worker can write in place; `receive` runs inside an open update.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from weightsync.wire.errors import BucketRejected
from weightsync.wire.protocol import LoadReport

if TYPE_CHECKING:
    from weightsync.engine.replica import ModelReceiver
    from weightsync.transports.p2p import PointToPointReceiver


class PointToPointInbox:
    """One engine worker's point-to-point receiver and the parameters it writes."""

    def __init__(self, receiver: ModelReceiver, *, name: str = "engine") -> None:
        self.receiver = receiver
        self.name = name
        self.p2p: PointToPointReceiver | None = None
        self.tensors: list[str] = []  # the trainer tensors this worker receives pieces of
        self.params: dict[str, str] = {}  # tensor -> the parameter it lands in

    def open(
        self,
        plan: dict[str, Any],
        worker: int,
        placements: dict[str, Any],
        *,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> str | None:
        """Join the plan's group as worker `worker` (the store at `host:port`, which trainer
        rank 0 hosts), writing each tensor where `placements` ({tensor: [parameter,
        patterns]}, as the worker's loader showed them) say. Returns why this worker cannot
        take the plan (then it joins nothing), or None."""
        from weightsync.transports.p2p import PointToPointReceiver
        from weightsync.wire.transfer_plan import TransferPlan

        parsed = TransferPlan.from_dict(plan)
        if not 0 <= worker < parsed.num_workers:
            return f"{self.name}: worker {worker} is not one of the plan's {parsed.num_workers}"
        tensors = sorted({move[0] for moves in parsed.receives(worker).values() for move in moves})
        params = dict(self.receiver.model.named_parameters())
        for tensor in tensors:
            placed = placements.get(tensor)
            if placed is None:
                return (
                    f"{self.name}: the plan writes tensor {tensor!r}, whose place this worker's "
                    f"loader has not shown (it lands in {self.receiver.param_of.get(tensor)})"
                )
            param = params[placed[0]]
            if param.element_size() != parsed.element_bytes[tensor]:
                return (
                    f"{self.name}: tensor {tensor!r} arrives in {parsed.element_bytes[tensor]}-"
                    f"byte elements, parameter {placed[0]!r} holds {param.dtype}: its loader "
                    f"converts, which the point-to-point path does not"
                )
            if not param.data.is_contiguous():
                return f"{self.name}: parameter {placed[0]!r} is not contiguous"
        for moves in parsed.receives(worker).values():  # every write inside its parameter
            for move in moves:
                name, dst, length, count, dst_stride = move[0], move[1], move[3], move[4], move[5]
                numel = params[placements[name][0]].numel()
                if dst < 0 or dst + (count - 1) * dst_stride + length > numel:
                    return (
                        f"{self.name}: the plan writes elements {dst}.."
                        f"{dst + (count - 1) * dst_stride + length} of parameter "
                        f"{placements[name][0]!r} for tensor {name!r}, which holds {numel}"
                    )
        self.close()
        self.p2p = PointToPointReceiver(
            parsed, worker, host=host, port=port, backend=backend, timeout_s=timeout_s
        )
        self.tensors = tensors
        self.params = {t: placements[t][0] for t in tensors}
        return None

    def receive(self, *, keep_previous: bool = False) -> LoadReport:
        """Inside an open update: this worker's pieces from every rank the plan links it with,
        each written to its place (with `keep_previous`, the parameters they land in are kept
        first, for a rollback)."""
        if self.p2p is None:
            raise RuntimeError(f"{self.name}: point-to-point receive before open")
        start = time.perf_counter()
        if keep_previous:
            self.receiver.previous.keep(self.tensors)
        try:
            got = self.p2p.receive_buffers()
        except Exception as exc:  # nothing written yet: the weights are still whole
            raise BucketRejected(
                f"{self.name}: the point-to-point receive failed before anything was "
                f"written: {type(exc).__name__}: {exc}"
            ) from exc
        params = dict(self.receiver.model.named_parameters())
        self.p2p.write({t: params[p].data.view(-1) for t, p in self.params.items()})
        return LoadReport(
            num_tensors=len(self.tensors),
            nbytes=sum(got.values()),
            seconds=time.perf_counter() - start,
        )

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
