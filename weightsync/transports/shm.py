"""POSIX shared memory between processes of one host (the CPU transport).

Segments live in /dev/shm, are created owner-only (0600) and are named
`weightsync-<creator pid>-<random>-<slot>` (engine actors' reply folders follow the same
`weightsync-<pid>-` naming). The sender unlinks its segments on close and at exit; a
segment whose creator died without unlinking is swept by the next sender on the host. The receiver
keeps each segment it mapped (the sender reuses its slots across buckets and syncs), so the pages
are mapped once and later syncs pay only the copy.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
import shutil
import weakref
from typing import Any

import torch

from weightsync.transports import ReceiverTransport, SenderTransport
from weightsync.wire import ALIGNMENT_BYTES, align

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "weightsync-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments whose creating process is gone. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            path = os.path.join(shm_dir, name)
            try:
                if os.path.isdir(path):  # an engine's reply folder
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    if removed:
        logger.info("removed %d stale shared-memory segments: %s", len(removed), removed)
    return removed


def list_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of weightsync segments present now (for leak checks)."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


class _Segment:
    """One mapped segment: its name, size, mmap and a uint8 tensor over it."""

    __slots__ = ("name", "nbytes", "_map", "tensor")

    def __init__(self, name: str, nbytes: int, *, create: bool, shm_dir: str) -> None:
        path = os.path.join(shm_dir, name)
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise RuntimeError(
                    f"shared-memory segment {name!r} is gone; the sender closed it or died"
                ) from None
            size = os.fstat(fd).st_size
            if size < nbytes:
                os.close(fd)
                raise ValueError(
                    f"shared-memory segment {name!r} holds {size} bytes, fewer than the "
                    f"{nbytes} the descriptor names"
                )
            nbytes = size
        try:
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.name = name
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None
        try:
            self._map.close()
        except BufferError:
            # A view is still alive somewhere; the mapping goes when the last view does.
            logger.debug("segment %s still has views; left to the garbage collector", self.name)


def _unlink_all(shm_dir: str, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            pass


class ShmSender(SenderTransport):
    """Owns `num_slots` shared-memory segments, grown on demand, unlinked on close or exit."""

    kind = "shm"

    def __init__(self, *, num_slots: int = 2, shm_dir: str = SHM_DIR) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: need at least 1")
        self._shm_dir = shm_dir
        self._token = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._slots: list[_Segment | None] = [None] * num_slots
        self._generation = 0
        # Names to unlink at exit even if close() is never called.
        self._names: list[str] = []
        self._finalizer = weakref.finalize(self, _unlink_all, shm_dir, self._names)
        atexit.register(self._finalizer)
        sweep_stale_segments(shm_dir)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        segment = self._slots[slot]
        if segment is None or segment.nbytes < nbytes:
            if segment is not None:
                self._drop(slot)
            self._generation += 1
            name = f"{self._token}-{slot}-{self._generation}"
            segment = _Segment(name, max(align(nbytes), ALIGNMENT_BYTES), create=True,
                               shm_dir=self._shm_dir)
            self._names.append(name)
            self._slots[slot] = segment
        return segment.tensor[:nbytes]

    def handle(self, slot: int) -> dict[str, Any]:
        segment = self._slots[slot]
        if segment is None:
            raise RuntimeError(f"shm: handle({slot}) before buffer({slot}, nbytes); a slot has "
                               f"bytes only once the sender asked for its buffer")
        return {"kind": self.kind, "name": segment.name, "nbytes": segment.nbytes}

    def _drop(self, slot: int) -> None:
        segment = self._slots[slot]
        if segment is None:
            return
        self._slots[slot] = None
        segment.close()
        _unlink_all(self._shm_dir, [segment.name])
        self._names.remove(segment.name)

    def close(self) -> None:
        for slot in range(len(self._slots)):
            self._drop(slot)
        self._finalizer()


class ShmReceiver(ReceiverTransport):
    """Maps the sender's segments by name and keeps the most recent few mapped."""

    def __init__(self, *, shm_dir: str = SHM_DIR, max_open: int = 4) -> None:
        self._shm_dir = shm_dir
        self._max_open = max_open
        self._open: dict[str, _Segment] = {}

    def receive(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        name = handle.get("name")
        if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shared-memory handle names {name!r}; expected '{PREFIX}...'")
        segment = self._open.pop(name, None)
        if segment is None:
            segment = _Segment(name, nbytes, create=False, shm_dir=self._shm_dir)
        elif segment.nbytes < nbytes:
            raise ValueError(
                f"shared-memory segment {name!r} holds {segment.nbytes} bytes, fewer than {nbytes}"
            )
        self._open[name] = segment  # most recently used last
        while len(self._open) > self._max_open:
            oldest = next(iter(self._open))
            self._open.pop(oldest).close()
        return segment.tensor[:nbytes]

    def forget(self, name: str) -> None:
        segment = self._open.pop(name, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for segment in self._open.values():
            segment.close()
        self._open.clear()
