"""A collective transport: the trainer broadcasts each bucket to every receiving process.

For engines on other hosts (or GPUs without CUDA IPC): gloo on CPU, NCCL on GPU. The group is its
own, built from a TCPStore the sender hosts, so it coexists with the trainer's and the engine's
default process groups and needs no `init_process_group` on either side. Receivers take ranks
1..N from a counter in the store as they join; the group forms on the first bucket, when the
sender broadcasts and every receiver waits in `receive`. Every wait has a timeout.

The store listens on `host` only (loopback by default; pass the host's address for engines on
other machines), on a port the kernel picks while the store holds it (weightsync/transports/rendezvous.py);
the handles carry it. The gloo group's devices listen on the address that reaches `host`.

With NCCL the copies overlap the broadcasts. Each side runs its broadcasts from a side stream:
the sender packs bucket i+1 into one slot while bucket i goes out of the other (a slot is packed
again only once its last broadcast finished: an event per slot), and each receiver keeps one
receive buffer per slot, so it receives bucket i+1 while the engine's loader copies bucket i out
(the broadcast into a buffer waits for the event `release` recorded after the last load from
it). The loader's stream waits for the broadcast on the GPU; no host waits for either.
A bucket of one contiguous tensor on the sender's GPU (large tensors get a bucket of their own)
is broadcast straight from the trainer's tensor (`attach`), with no copy into a slot; the
trainer's stream then waits for that broadcast before it can change the tensor.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync.transports import ReceiverTransport, SenderTransport
from weightsync.transports.rendezvous import gloo_device, host_store
from weightsync.wire.bucket import BucketPlan, write_tensor
from weightsync.wire.errors import CollectiveFailed

logger = logging.getLogger(__name__)


def _make_group(
    backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta, host: str
) -> Any:
    """`host`: the store's; a gloo device listens on the local address that reaches it."""
    prefixed = dist.PrefixStore(f"weightsync/{backend}", store)
    if backend == "gloo":
        # torch's stubs declare `Options` (at run time Backend.Options, with no `_devices`).
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [gloo_device(host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"collective backend {backend!r}: expected 'gloo' or 'nccl'")


def _start_broadcast(group: Any, tensor: torch.Tensor, timeout: datetime.timedelta) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timeout
    return group.broadcast([tensor], opts)


def _broadcast(group: Any, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    _start_broadcast(group, tensor, timeout).wait()


@contextlib.contextmanager
def _failing_as(what: str, fix: str) -> Iterator[None]:
    """torch's error from a store or a collective (its text names neither the peer nor what to
    do) raised again as `CollectiveFailed`: what was waited for, torch's words, the fix."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistError, DistStoreError and gloo errors derive it
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise CollectiveFailed(f"{what}: {first}. {fix}") from exc


class CollectiveSender(SenderTransport):
    """Rank 0 of a broadcast group of 1 + `num_receivers` processes; registered as "gloo" and
    "nccl", its `backend` (and the "kind" of its handles)."""

    takes_tensors = True

    @classmethod
    def create(
        cls, *, num_receivers: int, host: str, timeout_s: float, **options: Any
    ) -> CollectiveSender:
        return cls(num_receivers=num_receivers, host=host, timeout_s=timeout_s, **options)

    def __init__(
        self,
        *,
        num_receivers: int,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        port: int | None = None,
        num_slots: int = 2,
        timeout_s: float = 60.0,
    ) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}: need at least one receiver")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"collective backend {backend!r}: expected 'gloo' or 'nccl'")
        self.kind = self.backend = backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self.host = host
        self.world_size = 1 + num_receivers
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.TCPStore | None = host_store(
            host, port=port or 0, timeout_s=timeout_s, world_size=self.world_size
        )
        self.port = self.store.port
        self.group: Any = None
        self._slots: list[torch.Tensor | None] = [None] * num_slots
        self._sent: list[Any] = [None] * num_slots  # NCCL: event after the slot's broadcast
        self._stream: Any = None
        self._one_copy: list[torch.Tensor | None] = [None] * num_slots  # NCCL: sent in place

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def attach(self, slot: int, plan: BucketPlan, tensors: list[torch.Tensor]) -> None:
        """Broadcast a bucket of one tensor straight from it (NCCL); pack anything else."""
        if self.backend == "nccl" and len(tensors) == 1:
            tensor = tensors[0]
            if (
                tensor.device == self.device
                and tensor.is_contiguous()
                and 0 < tensor.numel() * tensor.element_size() == plan.nbytes
            ):
                self._one_copy[slot] = tensor
                return
        buf = self.buffer(slot, plan.nbytes)
        for meta, tensor in zip(plan.tensors, tensors):
            write_tensor(buf, meta, tensor)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        self._one_copy[slot] = None
        if self._sent[slot] is not None:  # writes into the slot wait for its last broadcast
            torch.cuda.current_stream(self.device).wait_event(self._sent[slot])
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._slots[slot] = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, device=self.device
            )
        return buf[:nbytes]

    def handle(self, slot: int) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "backend": self.backend,
            "host": self.host,
            "port": self.port,
            "world_size": self.world_size,
            "timeout_s": self.timeout.total_seconds(),
            "slot": slot,
        }

    def send(self, slot: int, nbytes: int) -> None:
        peers = (
            f"{self.world_size - 1} engine process(es) of the {self.backend} group at "
            f"{self.host}:{self.port}"
        )
        fix = (
            f"Is every engine alive, and does {self.host}:{self.port} reach this process "
            f"from theirs (SyncOptions.collective_host)? A slow engine needs a larger "
            f"SyncOptions.timeout_s (now {self.timeout.total_seconds():g} s)."
        )
        if self.group is None:
            logger.info(
                "forming %s group of %d on %s:%d",
                self.backend,
                self.world_size,
                self.host,
                self.port,
            )
            with _failing_as(
                f"{self.backend} sender: the {peers} did not all join within "
                f"{self.timeout.total_seconds():g} s",
                fix,
            ):
                self.group = _make_group(
                    self.backend, self.store, 0, self.world_size, self.timeout, self.host
                )
        one_copy = self._one_copy[slot]
        if one_copy is not None:
            data = one_copy.reshape(-1).view(torch.uint8)[:nbytes]
        else:
            buf = self._slots[slot]
            if buf is None:
                raise RuntimeError(
                    f"{self.backend}: send({slot}) before buffer({slot}, nbytes) "
                    f"or attach({slot}, ...); the slot holds nothing to send"
                )
            data = buf[:nbytes]
        if self.backend != "nccl":
            with _failing_as(
                f"{self.backend} sender: bucket slot {slot} ({nbytes} bytes) did "
                f"not reach all {peers} within {self.timeout.total_seconds():g} s",
                fix,
            ):
                _broadcast(self.group, data, self.timeout)
            return
        main = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(main)  # the bucket is packed (or the tensor written)
        with torch.cuda.stream(self._stream):
            _start_broadcast(self.group, data, self.timeout).wait()
            sent = torch.cuda.Event()
            sent.record(self._stream)
        self._sent[slot] = sent
        if one_copy is not None:
            main.wait_event(sent)  # the trainer changes the tensor only after it went out
            self._one_copy[slot] = None

    def close(self) -> None:
        if self.backend == "nccl" and self._stream is not None:
            self._stream.synchronize()
        self.group = None
        self._slots = [None] * len(self._slots)
        self._sent = [None] * len(self._sent)
        self._one_copy = [None] * len(self._one_copy)
        self.store = None


class CollectiveReceiver(ReceiverTransport):
    """Joins the sender's group on the first bucket; keeps one receive buffer."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, int], Any] = {}
        self._stores: dict[tuple[str, int], Any] = {}
        self._backends: dict[tuple[str, int], str] = {}
        self._buffer: torch.Tensor | None = None
        # NCCL: a receive buffer per sender slot, and the event after its last load
        self._buffers: dict[int, torch.Tensor] = {}
        self._loaded: dict[int, Any] = {}
        self._unreleased: set[int] = set()
        self._stream: Any = None

    def _group(self, handle: dict[str, Any]) -> Any:
        key = (handle["host"], int(handle["port"]))
        group = self._groups.get(key)
        if group is None:
            self._let_go_of_gone_senders()
            timeout = datetime.timedelta(seconds=float(handle.get("timeout_s", 60)))
            store = dist.TCPStore(
                key[0], key[1], int(handle["world_size"]), is_master=False, timeout=timeout
            )
            rank = int(store.add("weightsync/next_rank", 1))
            if rank >= int(handle["world_size"]):
                raise RuntimeError(
                    f"collective group at {key[0]}:{key[1]} is full "
                    f"(world size {handle['world_size']})"
                )
            group = _make_group(
                handle["backend"], store, rank, int(handle["world_size"]), timeout, key[0]
            )
            self._stores[key] = store
            self._groups[key] = group
            self._backends[key] = handle["backend"]
        return group

    # How long a kept group's store gets to answer before its sender counts as gone.
    store_check_s = 5.0

    def _let_go_of_gone_senders(self) -> None:
        """Before joining a new sender's group: the gloo groups of senders whose store no
        longer answers (their trainer is gone) are let go, with their threads and sockets. An
        engine that many trainers reach over its life (restarts, a group rebuilt after a
        failed sync) keeps the live senders' groups only. NCCL groups are kept (destroying a
        communicator whose peer died can block)."""
        for key, store in list(self._stores.items()):
            if self._backends.get(key) != "gloo":
                continue
            try:
                store.set_timeout(datetime.timedelta(seconds=self.store_check_s))
                store.num_keys()
            except (RuntimeError, OSError):  # torch's DistError derives RuntimeError
                logger.info("letting go of the gloo group of gone sender %s:%d", *key)
                self._groups.pop(key, None)
                self._stores.pop(key, None)
                self._backends.pop(key, None)

    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        timeout_s = float(handle.get("timeout_s", 60))
        where = (
            f"the trainer's {handle['backend']} sender (rank 0) at {handle['host']}:"
            f"{handle['port']}"
        )
        fix = (
            f"Is the trainer's rank 0 alive, and does {handle['host']} reach it from this "
            f"process (SyncOptions.collective_host)? A slow trainer needs a larger "
            f"SyncOptions.timeout_s (now {timeout_s:g} s)."
        )
        with _failing_as(f"engine receive: no group with {where} within {timeout_s:g} s", fix):
            group = self._group(handle)
        with _failing_as(
            f"engine receive: bucket slot {handle.get('slot', 0)} ({nbytes} bytes) "
            f"did not come from {where} within {timeout_s:g} s",
            fix,
        ):
            return self._receive(group, handle, nbytes)

    def _receive(self, group: Any, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        if handle["backend"] == "nccl":
            return self._receive_nccl(group, handle, nbytes)
        device = torch.device("cpu")
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        data = self._buffer[:nbytes]
        _broadcast(group, data, datetime.timedelta(seconds=float(handle.get("timeout_s", 60))))
        return data

    def _receive_nccl(self, group: Any, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        device = torch.device("cuda", torch.cuda.current_device())
        slot = int(handle.get("slot", 0))
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[slot] = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, device=device
            )
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        data = buf[:nbytes]
        loaded = self._loaded.pop(slot, None)
        if loaded is not None:  # the last load from this buffer is done before it is overwritten
            self._stream.wait_event(loaded)
        elif slot in self._unreleased:  # loaded without `release`: wait for all queued work
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._unreleased.add(slot)
        with torch.cuda.stream(self._stream):
            work = _start_broadcast(
                group, data, datetime.timedelta(seconds=float(handle.get("timeout_s", 60)))
            )
        work.wait()  # the loader's (current) stream waits for the bytes
        return data

    def release(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        if handle.get("backend") == "nccl":
            loaded = torch.cuda.Event()
            loaded.record(torch.cuda.current_stream())
            slot = int(handle.get("slot", 0))
            self._loaded[slot] = loaded
            self._unreleased.discard(slot)
        return None

    def close(self) -> None:
        if self._stream is not None:
            torch.cuda.synchronize()
        self._groups.clear()
        self._stores.clear()
        self._backends.clear()
        self._buffer = None
        self._buffers.clear()
        self._loaded.clear()
        self._unreleased.clear()
        self._stream = None
