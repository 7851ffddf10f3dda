"""CUDA IPC: the engine maps the trainer's GPU bucket buffer (same host, GPU memory).

The sender allocates one CUDA buffer per slot and exports it once with the CUDA IPC handle torch
itself uses (`UntypedStorage._share_cuda_()`); the handle, the device and sizes travel as plain
data (bytes and ints), and the receiver opens them with its own torch
(`UntypedStorage._new_shared_cuda`). Opened handles are cached: mapping costs ~ms, so each slot is
mapped once and reused across buckets and syncs. The sender synchronises its stream before
announcing a bucket, so the bytes are complete when the receiver reads them.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from weightsync.transports import ReceiverTransport, SenderTransport


def _export(storage: torch.UntypedStorage) -> dict[str, Any]:
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync_required) = storage._share_cuda_()
    return {"device": int(device), "handle": base64.b64encode(handle).decode(),
            "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes),
            "ref_handle": base64.b64encode(ref_handle).decode(), "ref_offset": int(ref_offset),
            "event_handle": base64.b64encode(event_handle or b"").decode(),
            "event_sync_required": bool(event_sync_required)}


def _open(h: dict[str, Any], device: int) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_cuda(
        device, base64.b64decode(h["handle"]), h["size_bytes"], h["offset_bytes"],
        base64.b64decode(h["ref_handle"]), h["ref_offset"],
        base64.b64decode(h["event_handle"]) or None, h["event_sync_required"])


class CudaIpcSender(SenderTransport):
    kind = "cuda_ipc"

    def __init__(self, *, num_slots: int = 2, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        self._slots: list[torch.Tensor | None] = [None] * num_slots
        self._handles: list[dict[str, Any] | None] = [None] * num_slots
        self._generation = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._generation += 1
            self._slots[slot] = buf
            self._handles[slot] = {**_export(buf.untyped_storage()),
                                   "key": f"{id(self)}-{slot}-{self._generation}"}
        return buf[:nbytes]

    def handle(self, slot: int) -> dict[str, Any]:
        handle = self._handles[slot]
        assert handle is not None, f"slot {slot} has no buffer yet"
        torch.cuda.current_stream(self.device).synchronize()
        return {"kind": self.kind, **handle}

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._slots = [None] * len(self._slots)
        self._handles = [None] * len(self._handles)


class CudaIpcReceiver(ReceiverTransport):
    kind = "cuda_ipc"

    def __init__(self, *, device: int | None = None, max_open: int = 4) -> None:
        self.device = device
        self.max_open = max_open
        self._open: dict[str, torch.Tensor] = {}

    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        key = handle["key"]
        data = self._open.pop(key, None)
        if data is None:
            device = handle["device"] if self.device is None else self.device
            storage = _open(handle, device)
            data = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
        if data.numel() < nbytes:
            raise ValueError(f"CUDA IPC buffer {key!r} holds {data.numel()} bytes, fewer than "
                             f"{nbytes}")
        self._open[key] = data
        while len(self._open) > self.max_open:
            self._open.pop(next(iter(self._open)))
        return data[:nbytes]

    def close(self) -> None:
        self._open.clear()
        torch.cuda.synchronize()
