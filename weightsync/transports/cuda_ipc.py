"""CUDA IPC: the engine reads the trainer's GPU memory directly (same host, same GPU or peer).

Zero-copy (the default): the sender exports CUDA IPC handles to the storages of the trainer's own
tensors (`UntypedStorage._share_cuda_()`, the handle torch itself uses) and the engine's loader
copies straight from them into its parameters: one copy per byte. Each storage is exported once
and the export is reused while that storage lives (same storage object at the same address);
a tensor in a new storage gets a new export and key, and the keys of storages that died travel
in the next handle ("drop"), so receivers unmap them and the trainer gets the memory back. The
receiver opens each key once (`UntypedStorage._new_shared_cuda`) and keeps it while it is used:
mapping costs ~ms, a view on an open storage microseconds.

Tensors that cannot be passed in place (on the CPU, on another GPU, empty) are copied into the
slot's bucket buffer as before, and the bucket path alone is used with `zero_copy=False`.

Replay: a bucket whose tensors sit where they sat the last time it was sent (same data pointers
and strides, and no exported storage died since, so every storage is the one described then) is
announced as {"same": True} with no views and no tensor list, and the receiver hands back the
views it made for that bucket then (their storages stay open). A bucket written into the slot's
buffer (the trainer's ranks filling it from their shards) is announced the same way when it was
described last time in the same buffer, of the same size: its tensors lie where they lay, and
the receiver's views of that buffer (and the copy lists it built on them) are reused. Receivers
keep replays per sender (every handle names its sender), for the last `MAX_SENDERS` senders, and
a sender replays only into engines whose previous update was its own (`BeginAnswer.replays`;
after another trainer's turn it describes every bucket in full once). The per-tensor work of a sync
(exports, view lists, descriptors, their pickling, checks and views on the receiver) then happens
once, on the first sync; later ones pay a pointer and strides comparison per tensor on the sender (in bulk: no Python per
tensor) and a list lookup per bucket on the receiver. `forget_replays()` (an engine added, a sync that failed)
sends every bucket in full again.

Only plain data crosses: handles as base64 text, offsets, strides and sizes as ints. Ordering:
the sender records an interprocess CUDA event of its slot on its stream when it announces a
bucket (after the trainer's writes) and sends the event's handle ("ready"); the receiver's
stream waits for that event before its loader reads (on the GPU: neither side's CPU waits, and
the receiver's copies start the moment the bucket is complete). Back the other way, where the
receiver's answer reaches the sender whole (`answers_reach_sender`: one receiving process per
engine) and the sender asks for it ("done" in the handle), `release` records an interprocess
event after the receiver's reads and answers its handle at once; the sender's stream waits for
it (`released`) before the slot is written again and after the last bucket, so the trainer's
next writes to its tensors come after the reads. Otherwise the receiver synchronises its stream
in `release` (its reads are done) before answering. Either way the receiver's `settle` (at the
end of an update) waits for its copies.
"""

from __future__ import annotations

import base64
import itertools
import math
import os
import secrets
import weakref
from typing import Any

import torch

from weightsync.transports import ReceiverTransport, SenderTransport
from weightsync.wire.bucket import BucketPlan, tensor_view, write_tensor
from weightsync.wire.errors import BucketRejected
from weightsync.wire.specs import BucketDescriptor, dtype_from_str, element_size

_uids = itertools.count()
MAX_SENDERS = 2  # senders whose replays a receiver keeps
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_Signature = tuple[list[int], list[tuple[int, ...]]]  # a bucket's tensors: data_ptrs, strides


def _export(storage: torch.UntypedStorage) -> dict[str, Any]:
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "device": int(device),
        "handle": base64.b64encode(handle).decode(),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_handle": base64.b64encode(ref_handle).decode(),
        "ref_offset": int(ref_offset),
        "event_handle": base64.b64encode(event_handle or b"").decode(),
        "event_sync_required": bool(event_sync_required),
    }


def _open(h: dict[str, Any], device: int) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_cuda(
        device,
        base64.b64decode(h["handle"]),
        h["size_bytes"],
        h["offset_bytes"],
        base64.b64decode(h["ref_handle"]),
        h["ref_offset"],
        base64.b64decode(h["event_handle"]) or None,
        h["event_sync_required"],
    )


def export_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """A CUDA storage's IPC export as plain data, for `open_storage` in another process."""
    return _export(storage)


def open_storage(export: dict[str, Any], device: int | None = None) -> torch.Tensor:
    """The storage `export_storage` described, opened here, as a flat uint8 tensor."""
    device = int(export["device"]) if device is None else device
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(_open(export, device))


class CudaIpcSender(SenderTransport):
    kind = "cuda_ipc"
    takes_tensors = True

    def __init__(
        self,
        *,
        num_slots: int = 2,
        device: int | None = None,
        zero_copy: bool = True,
        replay: bool = True,
    ) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        self.zero_copy = zero_copy
        self.replay = replay
        # plan index -> (([data_ptr], [strides]) of its tensors, deaths seen, views, exports)
        self._last: dict[int, tuple[_Signature, int, list[Any], dict[str, Any]]] = {}
        self._same: list[bool] = [False] * num_slots
        self._deaths = 0
        self._uid = f"{os.getpid()}.{secrets.token_hex(4)}.{next(_uids)}"
        self._slots: list[torch.Tensor | None] = [None] * num_slots
        self._handles: list[dict[str, Any] | None] = [None] * num_slots
        self._generation = 0
        # Zero-copy state: per slot, the tensors passed in place (kept alive until the slot is
        # reused) and their [key, storage offset, strides] (None: packed into the buffer).
        self._held: list[list[torch.Tensor] | None] = [None] * num_slots
        self._views: list[list[Any] | None] = [None] * num_slots
        self._packed: list[bool] = [False] * num_slots
        self._slot_exports: list[dict[str, Any]] = [{} for _ in range(num_slots)]
        # (data_ptr, nbytes) -> (weak ref to the storage, its export with "key")
        self._exports: dict[tuple[int, int], tuple[weakref.ref, dict[str, Any]]] = {}
        self._dead: list[str] = []
        self._sync = 0
        self._nbytes: list[int] = [0] * num_slots  # what `buffer` was last asked for
        # per slot: an interprocess event recorded when the slot is announced, and its handle
        self._ready: list[tuple[torch.cuda.Event, str] | None] = [None] * num_slots
        # plan index -> (buffer key, nbytes) it was last described in (buffer replays)
        self._described: dict[int, tuple[str, int]] = {}
        # the receivers' "done" events (`released`), by handle
        self._done: dict[str, torch.cuda.Event] = {}

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        self._views[slot] = None
        self._nbytes[slot] = nbytes
        return self._buffer(slot, nbytes)

    def describe(self, slot: int, index: int) -> dict[str, Any]:
        handle = self.handle(slot)
        if self._views[slot] is not None:  # tensors attached: replays are `attach`'s to find
            return handle
        self._last.pop(index, None)  # written into the buffer: no in-place replay of it
        where = (str(handle["key"]), self._nbytes[slot])
        if self.replay and self._described.get(index) == where:
            same = {"kind": self.kind, "device": self.device, "sync": self._sync, "same": True}
            return {**same, "sender": self._uid, "ready": handle["ready"], "done": True}
        self._described[index] = where
        return handle

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._generation += 1
            self._slots[slot] = buf
            self._handles[slot] = {
                **_export(buf.untyped_storage()),
                "key": f"{self._uid}-{slot}-{self._generation}",
            }
        return buf[:nbytes]

    # ---- zero-copy -----------------------------------------------------------------------
    def _storage_export(self, storage: torch.UntypedStorage) -> dict[str, Any]:
        where = (storage.data_ptr(), storage.nbytes())
        cached = self._exports.get(where)
        if cached is not None and cached[0]() is storage:
            return cached[1]
        self._generation += 1
        key = f"{self._uid}-s{self._generation}"
        export = {**_export(storage), "key": key}
        dead = self._dead

        def forget(ref: weakref.ref, where=where, key=key, exports=self._exports) -> None:
            dead.append(key)
            self._deaths += 1
            if exports.get(where, (None,))[0] is ref:
                del exports[where]

        self._exports[where] = (weakref.ref(storage, forget), export)
        return export

    def _in_place(self, tensor: torch.Tensor) -> bool:
        return (
            self.zero_copy
            and tensor.is_cuda
            and tensor.device.index == self.device
            and tensor.numel() > 0
            and all(s >= 0 for s in tensor.stride())
        )

    def attach(self, slot: int, plan: BucketPlan, tensors: list[torch.Tensor]) -> None:
        """Pass `plan`'s tensors in place where they can be, pack the rest into the slot's
        buffer; `handle(slot)` then describes both."""
        if plan.index == 0:
            self._sync += 1
        self._described.pop(plan.index, None)  # passed in place: no buffer replay of it
        self._held[slot] = None  # the slot's previous tensors may go (and their exports die)
        self._same[slot] = False
        signature = (
            (list(map(_data_ptr, tensors)), list(map(_stride, tensors))) if self.replay else None
        )
        last = self._last.get(plan.index)
        if last is not None and last[0] == signature and last[1] == self._deaths:
            self._held[slot], self._views[slot], self._slot_exports[slot] = tensors, last[2], {}
            self._packed[slot], self._same[slot] = False, True
            return
        views: list[Any] = []
        packed = [(meta, t) for meta, t in zip(plan.tensors, tensors) if not self._in_place(t)]
        if packed:
            buf = self._buffer(slot, plan.nbytes)
            for meta, tensor in packed:
                write_tensor(buf, meta, tensor)
        exports: dict[str, Any] = {}
        for tensor in tensors:
            if self._in_place(tensor):
                export = self._storage_export(tensor.untyped_storage())
                exports[export["key"]] = export
                views.append([export["key"], tensor.storage_offset(), list(tensor.stride())])
            else:
                views.append(None)
        self._held[slot] = tensors
        self._slot_exports[slot] = exports
        self._views[slot] = views
        self._packed[slot] = bool(packed)
        if signature is not None and not packed:
            self._last[plan.index] = (signature, self._deaths, views, exports)
        else:
            self._last.pop(plan.index, None)

    def forget_replays(self) -> None:
        self._last.clear()
        self._described.clear()

    def handle(self, slot: int) -> dict[str, Any]:
        views = self._views[slot]
        if views is None:
            handle = self._handles[slot]
            if handle is None:
                raise RuntimeError(
                    f"cuda_ipc: handle({slot}) before buffer({slot}, nbytes) or "
                    f"attach({slot}, ...); the slot holds nothing yet"
                )
            out = {"kind": self.kind, **handle}
        elif self._same[slot]:
            out = {"kind": self.kind, "device": self.device, "sync": self._sync, "same": True}
        else:
            out = {
                "kind": self.kind,
                "device": self.device,
                "sync": self._sync,
                "views": views,
                "storages": self._slot_exports[slot],
                "drop": self._dead[:],
            }
            self._dead.clear()
            if self._packed[slot]:
                out["buffer"] = self._handles[slot]
        out["sender"] = self._uid  # receivers keep replays per sender
        out["ready"] = self._record_ready(slot)
        out["done"] = True  # a receiver may answer `release` with an event (`released`)
        return out

    def released(self, answers: list[dict[str, Any] | None]) -> None:
        """This stream waits (on the GPU) for each receiver's "done" event: their reads of the
        slot come before anything queued after this."""
        stream = torch.cuda.current_stream(self.device)
        for answer in answers:
            text = (answer or {}).get("done")
            if not text:
                continue  # that receiver waited for its reads before answering
            event = self._done.get(text)
            if event is None:
                event = torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(text))
                self._done[text] = event
                while len(self._done) > 64:
                    self._done.pop(next(iter(self._done)))
            stream.wait_event(event)

    def _record_ready(self, slot: int) -> str:
        """Record the slot's event after everything the trainer queued so far (its writes into
        the slot, or to the tensors passed in place): the receiver's stream waits for it."""
        ready = self._ready[slot]
        if ready is None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(self.device))
                text = base64.b64encode(event.ipc_handle()).decode("ascii")
            ready = self._ready[slot] = (event, text)
        else:
            ready[0].record(torch.cuda.current_stream(self.device))
        return ready[1]

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._slots = [None] * len(self._slots)
        self._handles = [None] * len(self._handles)
        self._held = [None] * len(self._held)
        self._views = [None] * len(self._views)
        self._exports.clear()
        self._last.clear()
        self._described.clear()


class CudaIpcReceiver(ReceiverTransport):
    def __init__(
        self, *, device: int | None = None, max_open: int = 4, max_storages: int = 1 << 16
    ) -> None:
        self.device = device
        self.max_open = max_open
        self.max_storages = max_storages
        self._open: dict[str, torch.Tensor] = {}  # bucket buffers by key
        # key -> [storage, last sync used, {(offset, strides, shape, dtype): view}]
        self._storages: dict[str, list[Any]] = {}
        self._sync = 0
        # bucket index -> (nbytes, [(name, view)], the storage entries they use)
        # (sender, bucket index) -> (nbytes, [(name, view)], the storage entries they use):
        # per sender, so senders taking turns never get each other's views
        self._replays: dict[
            tuple[str, int], tuple[int, list[tuple[str, torch.Tensor]], list[list]]
        ] = {}
        self._events: dict[str, torch.cuda.Event] = {}  # the senders' slot events by handle
        # this receiver's events recorded after its reads of a sender's slot (by that slot's
        # "ready" handle), and their handles (`release`)
        self._done: dict[str, tuple[torch.cuda.Event, str]] = {}
        self._senders: list[str] = []  # senders with replays kept, least recent first

    def _seen(self, sender: str) -> None:
        """A sender's bucket arrived: keep the replays of the last `MAX_SENDERS` senders only
        (the views of a trainer that went away, and the buffers they map, are let go here; the
        loader's copy lists of them go when their buckets are described again)."""
        if sender in self._senders:
            self._senders.remove(sender)
        self._senders.append(sender)
        while len(self._senders) > MAX_SENDERS:
            gone = self._senders.pop(0)
            for key in [k for k in self._replays if k[0] == gone]:
                del self._replays[key]

    def _wait_ready(self, handle: dict[str, Any]) -> None:
        """Make this stream wait (on the GPU) for the sender's event of the slot: the bucket's
        bytes are all written before the loader reads them."""
        text = handle.get("ready")
        if text is None:
            raise BucketRejected("cuda_ipc handle without a 'ready' event: the sender is older")
        event = self._events.get(text)
        if event is None:
            device = self._device(handle)
            event = torch.cuda.Event.from_ipc_handle(device, base64.b64decode(text))
            self._events[text] = event
            while len(self._events) > 64:
                self._events.pop(next(iter(self._events)))
        torch.cuda.current_stream().wait_event(event)

    def _device(self, handle: dict[str, Any]) -> int:
        return int(handle["device"]) if self.device is None else self.device

    def _buffer(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        key = handle["key"]
        data = self._open.pop(key, None)
        if data is None:
            data = open_storage(handle, self._device(handle))
        if data.numel() < nbytes:
            raise BucketRejected(
                f"CUDA IPC buffer {key!r} holds {data.numel()} bytes, fewer than {nbytes}"
            )
        self._open[key] = data
        while len(self._open) > self.max_open:
            self._open.pop(next(iter(self._open)))
        return data[:nbytes]

    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        self._wait_ready(handle)
        return self._buffer(handle, nbytes)

    def _storage_nbytes(self, key: str, handle: dict[str, Any]) -> int:
        entry = self._storages.get(key)
        if entry is not None:
            return entry[0].nbytes()
        export = handle["storages"].get(key)
        if export is None:
            raise BucketRejected(
                f"CUDA IPC storage {key!r} is neither open here nor "
                f"exported in this bucket's handle"
            )
        return int(export["size_bytes"])

    def _storage(self, key: str, handle: dict[str, Any]) -> list[Any]:
        """The open storage's entry [storage, last sync used, {view signature: view}]."""
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [
                _open(handle["storages"][key], self._device(handle)),
                self._sync,
                {},
            ]
        entry[1] = self._sync
        return entry

    def _check_view(
        self,
        index: int,
        meta: Any,
        key: str,
        offset: int,
        stride: list[int],
        handle: dict[str, Any],
    ) -> None:
        if len(stride) != len(meta.shape) or offset < 0 or any(s < 0 for s in stride):
            raise BucketRejected(
                f"bucket {index}: tensor {meta.name!r}: bad offset {offset} / "
                f"strides {stride} for shape {meta.shape}"
            )
        span = (
            0
            if math.prod(meta.shape) == 0
            else 1 + sum((n - 1) * s for n, s in zip(meta.shape, stride))
        )
        nbytes = self._storage_nbytes(key, handle)
        if (offset + span) * element_size(meta.dtype) > nbytes:
            raise BucketRejected(
                f"bucket {index}: tensor {meta.name!r} spans elements [{offset}, "
                f"{offset + span}) of {meta.dtype}, beyond its storage's {nbytes} bytes"
            )

    def receive_tensors(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors: views of the trainer's storages where it passed them in place,
        views of the bucket buffer for the rest. A view is made (and checked against its
        storage's size) once, and reused while its storage stays open: later syncs of the same
        tensors pay a dictionary lookup per tensor."""
        handle = descriptor.handle
        if handle.get("same"):
            replayed = self._replay(descriptor)  # refused first when it holds none
            self._wait_ready(handle)
            self._seen(str(handle.get("sender")))
            return replayed
        self._wait_ready(handle)
        views = handle.get("views")
        self._replays.pop(_replay_key(descriptor), None)
        self._seen(str(handle.get("sender")))
        if views is None:
            whole = self._buffer(handle, descriptor.nbytes)
            descriptor.validate(whole.numel())
            out = [(m.name, tensor_view(whole, m)) for m in descriptor.tensors]
            # The views keep the buffer mapped while a later "same" may reuse them.
            self._replays[_replay_key(descriptor)] = (descriptor.nbytes, out, [])
            return out
        if len(views) != len(descriptor.tensors):
            raise BucketRejected(
                f"bucket {descriptor.index}: {len(views)} views for "
                f"{len(descriptor.tensors)} tensors"
            )
        for key in handle.get("drop", ()):
            self._storages.pop(key, None)
        sync = int(handle.get("sync", 0))
        if sync != self._sync:  # a new sync: unmap what the last one did not use
            self._storages = {k: e for k, e in self._storages.items() if e[1] >= self._sync}
            self._sync = sync
        data: torch.Tensor | None = None  # the buffer of the packed tensors, if any
        if any(v is None for v in views):
            if "buffer" not in handle:
                raise BucketRejected(f"bucket {descriptor.index}: packed tensors but no buffer")
            data = self._buffer(handle["buffer"], descriptor.nbytes)
            descriptor.validate(data.numel())
        places: list[Any] = []  # every new view is checked before any storage is opened
        for meta, view in zip(descriptor.tensors, views):
            if view is None:
                places.append(None)
                continue
            key, offset, stride = str(view[0]), int(view[1]), view[2]
            signature = (offset, tuple(stride), meta.shape, meta.dtype)
            entry = self._storages.get(key)
            made = entry[2].get(signature) if entry is not None else None
            if made is not None and entry is not None:
                entry[1] = self._sync
            else:
                stride = [int(s) for s in stride]
                self._check_view(descriptor.index, meta, key, offset, stride, handle)
            places.append((key, signature, made))
        out = []
        for meta, place in zip(descriptor.tensors, places):
            if place is None:
                if data is None:  # not reached: a None view opened the buffer above
                    raise RuntimeError(
                        f"bucket {descriptor.index}: tensor {meta.name!r} is packed but no "
                        f"buffer was opened for it"
                    )
                out.append((meta.name, tensor_view(data, meta)))
                continue
            key, signature, made = place
            if made is None:
                storage, _, made_here = self._storage(key, handle)
                offset, stride, shape, dtype = signature
                made = made_here[signature] = torch.empty(
                    0, dtype=dtype_from_str(dtype), device=storage.device
                ).set_(storage, offset, shape, stride)
            out.append((meta.name, made))
        while len(self._storages) > self.max_storages:
            self._storages.pop(next(iter(self._storages)))
        if data is None:  # every tensor in place: the sender may say "same" next time
            entries = {p[0]: self._storages[p[0]] for p in places if p[0] in self._storages}
            self._replays[_replay_key(descriptor)] = (
                descriptor.nbytes,
                out,
                list(entries.values()),
            )
        return out

    def _replay(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """The views made for this bucket the last time it was described in full."""
        cached = self._replays.get(_replay_key(descriptor))
        if cached is None or cached[0] != descriptor.nbytes:
            raise BucketRejected(
                f"bucket {descriptor.index}: the sender said 'same as last "
                f"time' but this receiver holds no views for it"
            )
        sync = int(descriptor.handle.get("sync", 0))
        if sync != self._sync:
            self._storages = {k: e for k, e in self._storages.items() if e[1] >= self._sync}
            self._sync = sync
        for entry in cached[2]:  # still in use: kept open
            entry[1] = sync
        return cached[1]

    def release(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        # The sender may reuse the slot, and the trainer change its tensors, once we reply:
        # once this stream's reads are done, or once the sender's stream waited for them.
        stream = torch.cuda.current_stream()
        ready = handle.get("ready")
        if not (self.answers_reach_sender and handle.get("done") and ready):
            stream.synchronize()
            return None
        done = self._done.get(ready)
        if done is None:
            with torch.cuda.device(self._device(handle)):
                event = torch.cuda.Event(interprocess=True)
                event.record(stream)
                done = (event, base64.b64encode(event.ipc_handle()).decode("ascii"))
            self._done[ready] = done
            while len(self._done) > 64:
                self._done.pop(next(iter(self._done)))
        else:
            self._done[ready] = self._done.pop(ready)  # the least recently used go first
            done[0].record(stream)
        return {"done": done[1]}

    def settle(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        torch.cuda.synchronize()
        self._open.clear()
        self._storages.clear()


def _replay_key(descriptor: BucketDescriptor) -> tuple[str, int]:
    return str(descriptor.handle.get("sender")), descriptor.index


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same GPU has the same one in every process, whatever its index."""
    return str(torch.cuda.get_device_properties(device).uuid)
