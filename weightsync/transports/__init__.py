"""Transports move a bucket's bytes from the trainer to an engine.

The sender owns a few buffers ("slots": double buffering lets the trainer fill one while the engine
loads the other). After filling a slot the sender hands the receiver `handle(slot)`, plain data
saying where the bytes are; the receiver maps or receives them as a 1-D uint8 tensor. Only raw
bytes and plain metadata cross, so sender and receiver may run different torch releases.

Order of calls for one bucket:
  sender:   buf = buffer(slot, nbytes); <write tensors into buf>; h = handle(slot)
  sender:   <ask the receiver to load bucket h>; send(slot, nbytes)   # collectives move bytes here
  receiver: tensors = receive_tensors(descriptor); <load them>; release(h)

Optional zero-copy capabilities, declared on the classes below: a sender transport with
`takes_tensors` is handed each bucket's tensors themselves (`attach`) instead of a buffer to
fill (CUDA IPC passes them in place, NCCL broadcasts a lone tensor straight from it); a receiver
transport may override `receive_tensors` to return the bucket's tensors without a byte buffer.

The registry below names every transport once, for both sides: `make_sender(name)` on the
trainer, `make_receiver(handle["kind"])` in the engine. Each side's module is imported only when
that side is made, so an engine env never imports the trainer's half, nor CUDA code on a CPU host.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.wire.bucket import unpack

if TYPE_CHECKING:
    from weightsync.wire.bucket import BucketPlan
    from weightsync.wire.specs import BucketDescriptor


class SenderTransport(ABC):
    """Trainer side of a transport. Used by the sending rank only, from one thread."""

    kind: str
    """The transport's registered name; every handle carries it as "kind"."""

    takes_tensors: ClassVar[bool] = False
    """True: the sender hands each bucket's tensors to `attach` instead of copying them into
    `buffer` (unless the trainer's ranks fill the buffers themselves)."""

    @classmethod
    def create(
        cls, *, num_receivers: int, host: str, timeout_s: float, **options: Any
    ) -> SenderTransport:
        """Called by `make_sender` for a sync into `num_receivers` engine processes; `host` is
        the trainer's address they may connect to, `timeout_s` bounds every wait. `options`
        are the registry's fixed options for this name. By default `cls(**options)`, for
        transports that need none of the three."""
        return cls(**options)

    @property
    def num_slots(self) -> int:
        """How many slots the sender cycles through; bucket i uses slot i % num_slots, and a
        slot is reused once every engine has loaded what it held. 1 unless overridden."""
        return 1

    @abstractmethod
    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """A writable 1-D uint8 tensor of exactly `nbytes` for `slot`, grown when needed."""

    def attach(self, slot: int, plan: BucketPlan, tensors: list[torch.Tensor]) -> None:
        """With `takes_tensors`: make `plan`'s tensors reachable through `handle(slot)`, in place
        where the transport can. Called instead of `buffer` for each bucket."""
        raise NotImplementedError(
            f"{type(self).__name__} does not take tensors "
            f"(takes_tensors is False); fill buffer() instead"
        )

    @abstractmethod
    def handle(self, slot: int) -> dict[str, Any]:
        """Plain data a receiver needs to reach `slot`'s bytes; includes "kind"."""

    def describe(self, slot: int, index: int) -> dict[str, Any]:
        """The handle announcing bucket `index`, which `slot` holds now: `handle(slot)`, or,
        for a transport that can say so, {"same": True} when the receivers may reuse what they
        made of this bucket's last description (nothing moved since)."""
        return self.handle(slot)

    def send(self, slot: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Move the bytes, for transports that push (collectives); called after the receiver
        was asked to receive. Shared memory and CUDA IPC need nothing here."""

    def released(self, answers: list[dict[str, Any] | None]) -> None:  # noqa: B027 - optional
        """The receivers' answers to `release` of one slot's bucket (each a plain dict, or None
        where the receiver waited until its reads were done): called before the slot is
        written again, and after the last bucket, so that whatever comes next on the trainer's
        side is ordered after those reads."""

    def forget_replays(self) -> None:  # noqa: B027 - optional hook
        """Describe every bucket in full from now on: called when the receivers may not all
        hold what earlier syncs described (an engine added, a sync that failed or skipped
        one). Only transports that send "same as last time" handles need it."""

    @abstractmethod
    def close(self) -> None:
        """Free every slot. Called once, when the sender is done for good."""


class ReceiverTransport(ABC):
    """Engine side of a transport. One per receiving process and kind, used from one thread."""

    # True where the answer to `release` reaches the sender whole (one receiving process per
    # engine, its load reports passed back as they are): a transport may then answer with
    # what the sender waits for (a CUDA event) instead of waiting itself.
    answers_reach_sender: bool = False

    @abstractmethod
    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the slot `handle` names, as a 1-D uint8 tensor (a view when
        the transport maps memory)."""

    def receive_tensors(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's (name, tensor) pairs; what the engine's loader reads. By default views
        of `receive`'s bytes laid out as the descriptor says; a transport that passes tensors
        in place (CUDA IPC) returns them itself."""
        return unpack(self.receive(descriptor.handle, descriptor.nbytes), descriptor)

    def release(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        """The bytes of `handle` are loaded: once this returns None the sender may overwrite
        them; a plain dict instead goes back to the sender's `released` (what to wait for)."""
        return None

    def settle(self) -> None:  # noqa: B027 - optional hook
        """Wait until everything loaded so far is written (the update ends)."""

    @abstractmethod
    def close(self) -> None:
        """Unmap everything this receiver opened."""


@dataclass(frozen=True, slots=True)
class _Entry:
    sender: str
    receiver: str
    options: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {}


def register_transport(name: str, *, sender: str, receiver: str, **options: Any) -> None:
    """Register transport `name`: its sender and receiver classes as "module:Class" (imported
    only when one is made) and fixed options for the sender's `create`. A name is registered
    once."""
    if name in _REGISTRY:
        raise ValueError(
            f"transport {name!r} is registered already (sender "
            f"{_REGISTRY[name].sender}); choose another name"
        )
    for side, target in (("sender", sender), ("receiver", receiver)):
        module, _, cls = target.partition(":")
        if not module or not cls:
            raise ValueError(f"transport {name!r}: {side}={target!r}: expected 'module:Class'")
    _REGISTRY[name] = _Entry(sender=sender, receiver=receiver, options=dict(options))


def transport_names() -> list[str]:
    """The registered transport names, in registration order."""
    return list(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; registered: {transport_names()}") from None


def _load(target: str) -> Any:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_sender(
    name: str, *, num_receivers: int, host: str = "127.0.0.1", timeout_s: float = 60.0
) -> SenderTransport:
    """The sender of transport `name`, importing its module only now (see `create`)."""
    entry = _entry(name)
    return _load(entry.sender).create(
        num_receivers=num_receivers, host=host, timeout_s=timeout_s, **entry.options
    )


def make_receiver(kind: str, **options: Any) -> ReceiverTransport:
    """A receiver for handles of `kind` (a registered name), importing its module only now."""
    return _load(_entry(kind).receiver)(**options)


register_transport(
    "shm",
    sender="weightsync.transports.shm:ShmSender",
    receiver="weightsync.transports.shm:ShmReceiver",
)
register_transport(
    "cuda_ipc",
    sender="weightsync.transports.cuda_ipc:CudaIpcSender",
    receiver="weightsync.transports.cuda_ipc:CudaIpcReceiver",
)
register_transport(
    "gloo",
    sender="weightsync.transports.collective:CollectiveSender",
    receiver="weightsync.transports.collective:CollectiveReceiver",
    backend="gloo",
)
register_transport(
    "nccl",
    sender="weightsync.transports.collective:CollectiveSender",
    receiver="weightsync.transports.collective:CollectiveReceiver",
    backend="nccl",
)
