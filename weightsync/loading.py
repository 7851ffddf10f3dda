"""Loading buckets, inside an engine's model process: transport bytes in, the engine's loader out.

Each bucket is checked against what the refit check accepted before any byte is read (a refusal
is `BucketRejected`: nothing was written), mapped as views through its transport, and handed to
the engine's own loader, so fused QKV, transposed Conv1D and tied heads stay the engine's
business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync.errors import BucketRejected
from weightsync.transports import ReceiverTransport, make_receiver

if TYPE_CHECKING:
    import torch

    from weightsync.refit import LoadFn, RefitCheck
    from weightsync.wire import BucketDescriptor


class BucketLoader:
    """Receives one model replica's buckets through their transports (one receiving transport
    per kind, kept open across syncs) and loads them through the engine's loader."""

    def __init__(self, refit: RefitCheck, *, load_fn: LoadFn, name: str = "engine") -> None:
        self.refit = refit
        self.load_fn = load_fn
        self.name = name
        self._transports: dict[str, ReceiverTransport] = {}

    def transport(self, kind: str) -> ReceiverTransport:
        """The receiving transport for handles of `kind`, made on first use."""
        transport = self._transports.get(kind)
        if transport is None:
            transport = self._transports[kind] = make_receiver(kind)
        return transport

    def check_descriptor(self, descriptor: BucketDescriptor) -> None:
        """Every tensor of the bucket was accepted by the refit check, with the same dtype and
        shape."""
        accepted = self.refit.accepted
        if not accepted:
            raise BucketRejected(f"{self.name}: load before check_refit; call check_refit first")
        for meta in descriptor.tensors:
            spec = accepted.get(meta.name)
            if spec is None:
                raise BucketRejected(f"{self.name}: bucket {descriptor.index} carries "
                                     f"{meta.name!r}, which refit info did not announce")
            if spec.shape != meta.shape or spec.dtype != meta.dtype:
                raise BucketRejected(
                    f"{self.name}: tensor {meta.name!r}: bucket has {meta.dtype} {meta.shape}, "
                    f"refit info announced {spec.dtype} {spec.shape}"
                )

    def receive(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """Views of one bucket's tensors, after checking them against refit info."""
        self.check_descriptor(descriptor)
        return self.transport(descriptor.handle["kind"]).receive_tensors(descriptor)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Through the engine's loaders, into the live parameters."""
        self.load_fn(iter(named_tensors))

    def release(self, descriptor: BucketDescriptor) -> None:
        """The bucket is loaded: its transport may hand the bytes back to the sender."""
        self.transport(descriptor.handle["kind"]).release(descriptor.handle)

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
