"""POSIX shared memory between processes of one host (the CPU transport).

Segments live in /dev/shm, are created owner-only (0600), new (O_EXCL: an existing file of the
name is refused, never reused) and allocated up front after a free-space check (so a segment
/dev/shm cannot hold raises instead of a SIGBUS on first touch), and are named
`weightsync-<creator pid>-<random>-<slot>` (engine actors' reply folders follow the same
`weightsync-<pid>-` naming). The sender unlinks its segments on close and at exit; a
segment whose creator died without unlinking is swept by the next sender on the host. The receiver
opens a segment only if it is a regular file of its own uid without group or other permission
bits, and keeps each segment it mapped (the sender reuses its slots across buckets and syncs), so
the pages are mapped once and later syncs pay only the copy.

Replay: a bucket the sender describes again in the same segment, of the same size, as the last
time (its tensors lie where they lay: the bucket plan is fixed) is announced as {"same": True}
with the segment's name and no tensor list; the receiver hands back the views it made of it
then, and the loader the copy lists it built on them, so a sync after the first pays no
per-tensor work for descriptors or views. A receiver that holds no views of that bucket in that
segment refuses it (`BucketRejected`) before anything is read; the sender then describes
everything in full (`forget_replays`). A receiver keeps the views of its `KEPT_SEGMENTS` most
recently used segments, so a sender replays only while it has that many slots or fewer, and
only into engines whose previous update was its own (`begin` says so: `BeginAnswer.replays`);
after another trainer's turn it describes every bucket in full once.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
import shutil
import stat
import weakref
from typing import Any

import torch

from weightsync.transports import ReceiverTransport, SenderTransport
from weightsync.wire.bucket import unpack
from weightsync.wire.errors import BucketRejected
from weightsync.wire.specs import ALIGNMENT_BYTES, BucketDescriptor, align

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "weightsync-"
KEPT_SEGMENTS = 4  # segments a receiver keeps mapped (and the views of their buckets)


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
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
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


def _free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


_ROOM_FIX = (
    "give the shared-memory filesystem more room (Docker: --shm-size, e.g. "
    "--shm-size=16g) or sync in smaller buckets (a smaller bucket_bytes)"
)


def _describe_mode(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o}"


def _create(path: str, nbytes: int, shm_dir: str) -> int:
    """A new owner-only file of `nbytes` allocated bytes at `path`; its open descriptor."""
    free_bytes = _free_bytes(shm_dir)
    if nbytes > free_bytes:
        raise RuntimeError(
            f"shared-memory segment {path!r} needs {nbytes} bytes but {shm_dir} has "
            f"{free_bytes} free; {_ROOM_FIX}"
        )
    try:
        # O_EXCL: a file already at this name (planted, or a stale one) is never reused; names
        # carry 32 random bits, so a clash is not chance. It does not follow a symlink either.
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        try:
            found = _describe_mode(os.lstat(path))
        except FileNotFoundError:
            found = "removed since"
        raise RuntimeError(
            f"shared-memory segment {path!r} exists already ({found}); weightsync creates each "
            f"segment new and never reuses a file; remove it if no weightsync process of yours "
            f"made it"
        ) from None
    try:
        # Allocated now, not on first touch: a segment /dev/shm cannot hold fails here instead
        # of killing the process with SIGBUS when a page is first written.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise RuntimeError(
            f"shared-memory segment {path!r}: allocating {nbytes} bytes failed "
            f"({exc.strerror}; {shm_dir} had {free_bytes} free); {_ROOM_FIX}"
        ) from None
    return fd


def _open_own(path: str, name: str, nbytes: int) -> tuple[int, int]:
    """Open an existing segment only if this user alone can access it and it holds `nbytes`;
    returns its descriptor and size."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RuntimeError(
            f"shared-memory segment {name!r} is gone; the sender closed it or died"
        ) from None
    except OSError:
        if not os.path.islink(path):
            raise
        raise RuntimeError(
            f"shared-memory segment {path!r} is a symbolic link; weightsync maps only regular "
            f"files its own processes created; remove it"
        ) from None
    st = os.fstat(fd)
    if (
        st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) & 0o077
        or not stat.S_ISREG(st.st_mode)
    ):
        os.close(fd)
        raise RuntimeError(
            f"shared-memory segment {path!r} has {_describe_mode(st)}; weightsync maps only "
            f"regular files owned by its own uid ({os.geteuid()}) with no group or other "
            f"permission bits (its senders create them 0o600): run the trainer and the engines "
            f"as the same user, and remove the file if no weightsync process of that user "
            f"made it"
        )
    if st.st_size < nbytes:
        os.close(fd)
        raise ValueError(
            f"shared-memory segment {name!r} holds {st.st_size} bytes, fewer than the "
            f"{nbytes} the descriptor names"
        )
    return fd, st.st_size


class _Segment:
    """One mapped segment: its name, size, mmap and a uint8 tensor over it.

    `create=True` makes a new owner-only file (refusing an existing one, and a size its
    directory has no room for); `create=False` opens one only if it is this user's alone."""

    __slots__ = ("name", "nbytes", "_map", "_tensor")

    def __init__(self, name: str, nbytes: int, *, create: bool, shm_dir: str) -> None:
        path = os.path.join(shm_dir, name)
        if create:
            fd = _create(path, nbytes, shm_dir)
        else:
            fd, nbytes = _open_own(path, name, nbytes)
        try:
            mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._map: mmap.mmap | None = mapped
        self.name = name
        self.nbytes = nbytes
        self._tensor: torch.Tensor | None = torch.frombuffer(mapped, dtype=torch.uint8)

    @property
    def tensor(self) -> torch.Tensor:
        """The segment's bytes, as uint8."""
        if self._tensor is None:
            raise RuntimeError(
                f"shared-memory segment {self.name!r} was closed; map it again to use its bytes"
            )
        return self._tensor

    def close(self) -> None:
        """Let go of the mapping: it is unmapped when the last tensor over it goes. Never
        unmapped here: `torch.frombuffer` holds no buffer export, so `mmap.close()` would unmap
        under live views (a later write through one lands in whatever is mapped there next)."""
        self._tensor = None
        self._map = None


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
        """With more than `KEPT_SEGMENTS` slots no bucket is replayed (see the module doc)."""
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
        self._nbytes: list[int] = [0] * num_slots  # what `buffer` was last asked for
        self._described: dict[int, tuple[str, int]] = {}  # bucket -> (segment, nbytes)
        self._replays = num_slots <= KEPT_SEGMENTS

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
            segment = _Segment(
                name, max(align(nbytes), ALIGNMENT_BYTES), create=True, shm_dir=self._shm_dir
            )
            self._names.append(name)
            self._slots[slot] = segment
        self._nbytes[slot] = nbytes
        return segment.tensor[:nbytes]

    def describe(self, slot: int, index: int) -> dict[str, Any]:
        handle = self.handle(slot)
        where = (str(handle["name"]), self._nbytes[slot])
        if self._replays and self._described.get(index) == where:
            return {**handle, "same": True}
        self._described[index] = where
        return handle

    def forget_replays(self) -> None:
        self._described.clear()

    def handle(self, slot: int) -> dict[str, Any]:
        segment = self._slots[slot]
        if segment is None:
            raise RuntimeError(
                f"shm: handle({slot}) before buffer({slot}, nbytes); a slot has "
                f"bytes only once the sender asked for its buffer"
            )
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
        self._described.clear()
        self._finalizer()


class ShmReceiver(ReceiverTransport):
    """Maps the sender's segments by name and keeps the most recent few mapped."""

    def __init__(self, *, shm_dir: str = SHM_DIR, max_open: int = KEPT_SEGMENTS) -> None:
        self._shm_dir = shm_dir
        self._max_open = max_open
        self._open: dict[str, _Segment] = {}
        # (segment name, bucket index) -> (nbytes, its views) for "same" buckets: keyed by
        # segment too, so senders taking turns (each with its own segments) keep theirs
        self._replays: dict[tuple[str, int], tuple[int, list[tuple[str, torch.Tensor]]]] = {}

    def receive_tensors(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's views, made once per bucket and segment (see the module doc)."""
        handle = descriptor.handle
        name = str(handle.get("name"))
        if handle.get("same"):
            cached = self._replays.get((name, descriptor.index))
            if cached is None or cached[0] != descriptor.nbytes or name not in self._open:
                raise BucketRejected(
                    f"bucket {descriptor.index}: the sender said 'same as last time' but this "
                    f"receiver holds no views for it in segment {name!r}"
                )
            self._open[name] = self._open.pop(name)  # most recently used last
            return cached[1]
        views = unpack(self.receive(handle, descriptor.nbytes), descriptor)
        self._replays[(name, descriptor.index)] = (descriptor.nbytes, views)
        return views

    def _close(self, name: str) -> None:
        segment = self._open.pop(name, None)
        if segment is not None:
            segment.close()
        for key in [k for k in self._replays if k[0] == name]:
            del self._replays[key]  # the views held the mapping

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
            self._close(next(iter(self._open)))
        return segment.tensor[:nbytes]

    def forget(self, name: str) -> None:
        self._close(name)

    def close(self) -> None:
        for segment in self._open.values():
            segment.close()
        self._open.clear()
        self._replays.clear()
