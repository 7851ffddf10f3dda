"""A collective transport: the trainer broadcasts each bucket to every receiving process.

For engines on other hosts (or GPUs without CUDA IPC): gloo on CPU, NCCL on GPU. The group is its
own, built from a TCPStore the sender hosts, so it coexists with the trainer's and the engine's
default process groups and needs no `init_process_group` on either side. Receivers take ranks
1..N from a counter in the store as they join; the group forms on the first bucket, when the
sender broadcasts and every receiver waits in `receive`. Every wait has a timeout.

The store's port is opened on `host` (loopback by default); pass the host's address for engines
on other machines.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from weightsync.transports import ReceiverTransport, SenderTransport

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _make_group(backend: str, store: Any, rank: int, world_size: int,
                timeout: datetime.timedelta) -> Any:
    prefixed = dist.PrefixStore(f"weightsync/{backend}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"collective backend {backend!r}: expected 'gloo' or 'nccl'")


def _broadcast(group: Any, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timeout
    group.broadcast([tensor], opts).wait()


class CollectiveSender(SenderTransport):
    """Rank 0 of a broadcast group of 1 + `num_receivers` processes."""

    kind = "collective"

    def __init__(self, *, num_receivers: int, backend: str = "gloo", host: str = "127.0.0.1",
                 port: int | None = None, num_slots: int = 2, timeout_s: float = 60.0) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}: need at least one receiver")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"collective backend {backend!r}: expected 'gloo' or 'nccl'")
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self.host = host
        self.port = port or _free_port(host)
        self.world_size = 1 + num_receivers
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, self.port, self.world_size, is_master=True,
                                   timeout=self.timeout, wait_for_workers=False)
        self.group: Any = None
        self._slots: list[torch.Tensor | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._slots[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                                  device=self.device)
        return buf[:nbytes]

    def handle(self, slot: int) -> dict[str, Any]:
        return {"kind": self.kind, "backend": self.backend, "host": self.host,
                "port": self.port, "world_size": self.world_size,
                "timeout_s": self.timeout.total_seconds()}

    def send(self, slot: int, nbytes: int) -> None:
        if self.group is None:
            logger.info("forming %s group of %d on %s:%d", self.backend, self.world_size,
                        self.host, self.port)
            self.group = _make_group(self.backend, self.store, 0, self.world_size, self.timeout)
        buf = self._slots[slot]
        assert buf is not None, f"slot {slot} has no buffer"
        _broadcast(self.group, buf[:nbytes], self.timeout)

    def close(self) -> None:
        self.group = None
        self._slots = [None] * len(self._slots)
        self.store = None


class CollectiveReceiver(ReceiverTransport):
    """Joins the sender's group on the first bucket; keeps one receive buffer."""

    kind = "collective"

    def __init__(self) -> None:
        self._groups: dict[tuple[str, int], Any] = {}
        self._stores: dict[tuple[str, int], Any] = {}
        self._buffer: torch.Tensor | None = None

    def _group(self, handle: dict[str, Any]) -> Any:
        key = (handle["host"], int(handle["port"]))
        group = self._groups.get(key)
        if group is None:
            timeout = datetime.timedelta(seconds=float(handle.get("timeout_s", 60)))
            store = dist.TCPStore(key[0], key[1], int(handle["world_size"]), is_master=False,
                                  timeout=timeout)
            rank = int(store.add("weightsync/next_rank", 1))
            if rank >= int(handle["world_size"]):
                raise RuntimeError(f"collective group at {key[0]}:{key[1]} is full "
                                   f"(world size {handle['world_size']})")
            group = _make_group(handle["backend"], store, rank, int(handle["world_size"]),
                                timeout)
            self._stores[key] = store
            self._groups[key] = group
        return group

    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        group = self._group(handle)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if handle["backend"] == "nccl" else torch.device("cpu")
        if self._buffer is None or self._buffer.numel() < nbytes or \
                self._buffer.device != device:
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        data = self._buffer[:nbytes]
        _broadcast(group, data, datetime.timedelta(seconds=float(handle.get("timeout_s", 60))))
        return data

    def close(self) -> None:
        self._groups.clear()
        self._stores.clear()
        self._buffer = None
