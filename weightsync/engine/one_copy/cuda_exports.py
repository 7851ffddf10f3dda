"""The one-copy path on a GPU: the engine exports its parameters' CUDA storages, trainer ranks
on the same host write their shards straight into them.

As on the CPU (weightsync/trainer/one_copy/targets.py), a probe through the engine's own loader first finds where
each trainer tensor lands (parameter, byte offset). Unlike the CPU, nothing moves: each
parameter's storage is exported once with CUDA IPC (`UntypedStorage._share_cuda_()`, as the
CUDA IPC transport exports the trainer's tensors), and a trainer rank opens it and copies into
it (`OneCopyTarget`). No GPU memory is added. The export names its GPU by UUID: the trainer takes
this path only when every rank's shards are on that same GPU (weightsync/trainer/one_copy/path.py; copies
between GPUs were not run, so they are not offered).

Only plain data crosses: the exports (handles as base64 text) and {tensor: [storage index, byte
offset]}. Before every update and at its end the engine confirms that every parameter still
lives where it was exported (same address, contiguous) and waits for its own GPU work, so the
trainer writes into idle parameters; the trainer waits for its copies (`OneCopyTarget.flush`)
before it reports the update written.

What an export does not do: torch counts one consumer per export, and here several ranks may
open one. The parameters stay alive as long as the engine shares them. No update with
`keep_previous` takes this path (`ModelReceiver.begin_one_copy`): putting the previous weights back
while a late rank may still write needs the parameters to take new memory (the CPU's fence), and
an engine's captured CUDA graphs would go on reading the old addresses.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

from weightsync.engine.one_copy.segment import moved_from
from weightsync.transports.cuda_ipc import device_uuid, export_storage
from weightsync.wire.errors import NotShared


class CudaParameters:
    """Engine parameters on one GPU, exported for the trainer's writes. Same interface as
    `SharedParameters` (weightsync/trainer/one_copy/targets.py)."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        destinations: dict[str, tuple[str, int]],
        *,
        placements: dict[str, Any] | None = None,
    ) -> None:
        names = sorted({pname for pname, _ in destinations.values()})
        self.params = {pname: params[pname] for pname in names}
        devices = {p.device for p in self.params.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"CUDA one-copy parameters must all be on one GPU, got {devices}")
        self.device = next(iter(devices))
        self._ptrs = [param.data_ptr() for param in self.params.values()]  # where each lives
        storages: dict[int, int] = {}  # storage address -> index in `exports`
        self.exports: list[dict[str, Any]] = []
        where: dict[str, tuple[int, int]] = {}  # parameter -> (storage index, byte offset)
        for pname, param in self.params.items():
            storage = param.untyped_storage()
            index = storages.get(storage.data_ptr())
            if index is None:
                index = storages[storage.data_ptr()] = len(self.exports)
                self.exports.append(export_storage(storage))
            where[pname] = (index, param.data_ptr() - storage.data_ptr())
        self.tensor_where = {
            t: [where[p][0], where[p][1] + off] for t, (p, off) in destinations.items()
        }
        self.placed = {
            t: [params[p].element_size(), pats] for t, (p, pats) in (placements or {}).items()
        }
        # Names this sharing (a new one after the parameters moved and were shared again).
        self.owner = self.token = f"pid {os.getpid()} share {secrets.token_hex(4)}"
        self.label = (
            f"{len(self.exports)} CUDA storage(s) on {self.device} "
            f"({sum(p.nbytes for p in self.params.values())} bytes of parameters)"
        )

    def describe(self) -> dict[str, Any]:
        """What a trainer rank needs to write here (plain data); `token` names this sharing
        (a trainer names the sharings it holds mapped when it begins a one-copy update)."""
        out: dict[str, Any] = {
            "token": self.token,
            "cuda": {
                "owner": self.owner,
                "storages": self.exports,
                "uuid": device_uuid(self.device),
            },
            "offsets": dict(self.tensor_where),
        }
        if self.placed:
            out["placed"] = self.placed
        return out

    def moved(self, current: list[Any] | None = None) -> list[str]:
        """Parameters that no longer live where they were exported. `current`: what is
        registered in each one's place now, in `params` order (None: unregistered); default
        the parameters as shared. Checked in bulk first: thousands of parameters in an MoE,
        twice a sync."""
        params = list(self.params.values()) if current is None else current
        return moved_from(self.params, params, self._ptrs)

    def check(self, current: list[Any] | None = None) -> None:
        """Raise `NotShared` unless every parameter still lives where it was exported (see
        `moved`); wait for this process's GPU work on them first (the trainer writes next, or
        has written)."""
        torch.cuda.synchronize(self.device)
        moved = self.moved(current)
        if moved:
            raise NotShared(
                f"{len(moved)} parameter(s) no longer live in their exported CUDA "
                f"storage, e.g. {moved[:3]} (reloaded by the engine?); the trainer "
                f"syncs by buckets and shares them again"
            )

    def close(self) -> None:
        """Forget the exports (the trainer's mappings close with its targets)."""
        self.exports = []
