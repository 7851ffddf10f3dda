"""Transports move a bucket's bytes from the trainer to an engine.

The sender owns a few buffers ("slots": double buffering lets the trainer fill one while the engine
loads the other). After filling a slot the sender hands the receiver `handle(slot)`, plain data
saying where the bytes are; the receiver maps or receives them as a 1-D uint8 tensor. Only raw
bytes and plain metadata cross, so sender and receiver may run different torch releases.

Order of calls for one bucket:
  sender:   buf = buffer(slot, nbytes); <write tensors into buf>; h = handle(slot)
  sender:   <ask the receiver to load bucket h>; send(slot, nbytes)   # collectives move bytes here
  receiver: data = receive(h, nbytes); <load views of data>; release(h)

Optional zero-copy hooks (CUDA IPC offers them): a sender transport with
`attach(slot, plan, tensors)` is handed each bucket's tensors themselves instead of a buffer to
fill, and makes them reachable through `handle(slot)`; a receiver transport with
`receive_tensors(descriptor)` returns the bucket's (name, tensor) views itself.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

# kind -> "module:Class" of the receiving side, imported only when a handle of that kind arrives.
_RECEIVERS: dict[str, str] = {
    "shm": "weightsync.transports.shm:ShmReceiver",
    "cuda_ipc": "weightsync.transports.cuda_ipc:CudaIpcReceiver",
    "collective": "weightsync.transports.collective:CollectiveReceiver",
}


class SenderTransport(ABC):
    """Trainer side of a transport. Used by the sending rank only, from one thread."""

    kind: ClassVar[str]

    @abstractmethod
    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """A writable 1-D uint8 tensor of exactly `nbytes` for `slot`, grown when needed."""

    @abstractmethod
    def handle(self, slot: int) -> dict[str, Any]:
        """Plain data a receiver needs to reach `slot`'s bytes; includes "kind"."""

    def send(self, slot: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Move the bytes, for transports that push (collectives); called after the receiver
        was asked to receive. Shared memory and CUDA IPC need nothing here."""

    @abstractmethod
    def close(self) -> None:
        """Free every slot. Called once, when the sender is done for good."""


class ReceiverTransport(ABC):
    """Engine side of a transport. One per receiving process, used from one thread."""

    kind: ClassVar[str]

    @abstractmethod
    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the slot `handle` names, as a 1-D uint8 tensor (a view when
        the transport maps memory)."""

    def release(self, handle: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """The bytes of `handle` are loaded; the sender may overwrite them."""

    @abstractmethod
    def close(self) -> None:
        """Unmap everything this receiver opened."""


def receiver_for(kind: str, **options: Any) -> ReceiverTransport:
    """A receiver for handles of `kind`, importing its module only now."""
    try:
        target = _RECEIVERS[kind]
    except KeyError:
        raise ValueError(f"unknown transport kind {kind!r}; known: {sorted(_RECEIVERS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
