"""Syncing a stock engine: one that runs nothing of weightsync's, updated through its own reload.

A framework's own `vllm serve` or `sglang.launch_server`, started without weightsync's worker
extension or weight loader, can still load a new checkpoint from disk through its own API
(vLLM's `reload_weights`, SGLang's `update_weights_from_disk`). `StockEngine` is the engine
actor for such a server, run in the engine's env on the server's host: it takes the trainer's
buckets like any engine actor, writes them straight into a safetensors checkpoint in a staging
folder (`StagedCheckpoint`: a file in /dev/shm, mapped, each tensor a view of its bytes), and at
`end` has the engine reload that folder (each backend's `_reload`).

What it gives: the engine's weights change only inside the engine's own reload, at `end`, so an
update aborted before then leaves the engine serving its previous weights (nothing to roll
back); the refit check is made against the checkpoint the server was started from (names, shapes and
dtypes: the engine casts what it reloads as it did at start) before anything is written; any transport and any trainer.
What it cannot give, as nothing of weightsync's runs in the engine: verification (the engine's
weights cannot be read back: `RefitAnswer.unverifiable` says so and the trainer refuses
`verify=True`), the one-copy path, a refit dry run of the engine's own loader, and a rollback
when the engine's reload itself fails half way (the engine then refuses to serve until a later
sync completes). Each sync reads the whole checkpoint back from the staging file: slower than
weightsync's own paths (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from abc import abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from weightsync.engine.refit import (
    SAFETENSORS_DTYPES,
    check_against_checkpoint,
    checkpoint_specs,
    copy_loader,
)
from weightsync.engine.replica import ModelReceiver
from weightsync.engine.server import RemoteServer
from weightsync.engine.session import EngineSession
from weightsync.wire.protocol import EndReport, LoadReport, StageReport
from weightsync.wire.specs import BucketDescriptor, TensorSpec, dtype_from_str, specs_from_dicts

if TYPE_CHECKING:
    from collections.abc import Iterable

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "model.safetensors"


def _module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are `tensors` (not copied), named as given ("a.b.weight" is
    parameter "weight" of submodule "a.b")."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


class StagedCheckpoint:
    """A safetensors checkpoint in `folder` whose tensors are writable views of its bytes: the
    file is laid out once (safetensors' format: an 8-byte header length, the JSON header,
    the data) and mapped shared, so what is written into `tensors` is what an engine reading
    the file reads. Beside it, links to the other files of `source` (config, tokenizer), so an
    engine can load the folder as a model."""

    def __init__(self, folder: str, specs: list[TensorSpec], source: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, CHECKPOINT_FILE)
        for name in os.listdir(source):
            if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
                os.symlink(os.path.join(source, name), os.path.join(folder, name))
        header: dict[str, Any] = {}
        offset = 0
        # Back to back (safetensors allows no gaps), widest elements first: every tensor starts
        # at a multiple of its element size, so each can be viewed in its dtype.
        itemsize = {s.name: dtype_from_str(s.dtype).itemsize for s in specs}
        for spec in sorted(specs, key=lambda s: -itemsize[s.name]):
            code = SAFETENSORS_DTYPES.get(spec.dtype)
            if code is None:
                raise ValueError(
                    f"tensor {spec.name!r}: dtype {spec.dtype} has no safetensors code"
                )
            header[spec.name] = {
                "dtype": code,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        start = 8 + len(raw)
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(start + offset)  # zeros, allocated as they are written
        mapped = torch.from_file(self.path, shared=True, size=start + offset, dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {}
        for spec in specs:
            begin, end = header[spec.name]["data_offsets"]
            view = mapped[start + begin : start + end]
            self.tensors[spec.name] = view.view(dtype_from_str(spec.dtype)).view(spec.shape)

    def fill_from(self, source: str, names: Iterable[str]) -> None:
        """Copy the tensors `names` from the safetensors files of folder `source`."""
        from safetensors import safe_open

        wanted = set(names)
        for file in sorted(os.listdir(source)):
            if not file.endswith(".safetensors") or not wanted:
                continue
            with safe_open(os.path.join(source, file), framework="pt") as f:
                for name in wanted & set(f.keys()):
                    self.tensors[name].copy_(f.get_tensor(name))
                    wanted.discard(name)


class StockEngine(EngineSession):
    """The engine actor of a stock engine's server (module doc). A backend gives `_reload`
    and, from the server, `model_path` (the checkpoint it was started from, on this host) and
    `tp_size`.

    `staging_dir`: where the staged checkpoint's folder is made (default /dev/shm, which holds
    it in memory: the whole model, once; the server reads it from there)."""

    engine_name = "stock"
    model_path: str
    tp_size: int = 1

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        staging_dir: str | None = None,
        idle_timeout_s: float = 60.0,
    ) -> None:
        """`url`: the server's (`api_key` its key, if it has one); the backend's `_describe`
        then reads from it what it serves. None for a subclass that sets those itself."""
        super().__init__(idle_timeout_s=idle_timeout_s)
        self.staging_dir = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._staged: StagedCheckpoint | None = None
        self._receiver: ModelReceiver | None = None
        self._reloading = False
        if url is not None:
            self.server = RemoteServer(url, name=self.engine_name, api_key=api_key)
            self.where = f"{self.engine_name} server at {self.server.base}"
            self._keyed = api_key is not None
            self._describe()
            self._check_model_path()

    def _describe(self) -> None:
        """Set `model_path` and `tp_size` from the server (a backend's)."""
        raise NotImplementedError(f"{type(self).__name__} reads no server")

    def _get(self, path: str) -> Any:
        """GET `path`'s JSON; PermissionError naming the fix when the server refuses the key
        (or its absence), RuntimeError for any other status but 200."""
        status, out = self.server.request("GET", path)
        if status == 401:
            raise PermissionError(
                f"{self.where} refused "
                + ("the API key given" if self._keyed else "a request without an API key")
                + f" on {path}: pass api_key= the key it was started with (--api-key)"
            )
        if status != 200 or not isinstance(out, dict):
            raise RuntimeError(f"{self.where}: {path} answered {status}: {out}")
        return out

    def _check_model_path(self) -> None:
        """Refuse a server whose checkpoint this actor cannot read: it is on another host."""
        where = self.where
        if not os.path.isdir(self.model_path):
            raise ValueError(
                f"{where} serves {self.model_path!r}, which is not a folder on this host: the "
                f"stock path stages a checkpoint the server reads from disk, so run this actor "
                f"on the server's host (and start the server from a local checkpoint folder)"
            )

    @property
    def unverifiable(self) -> str:
        return (
            f"{self.engine_name} runs nothing of weightsync's (a stock engine, updated through "
            f"its own reload): its weights cannot be read back, so syncs into it are not "
            f"verified; sync with verify=False, or start the engine with weightsync's "
            f"{'worker extension' if self.engine_name == 'vllm' else 'weight loader'} "
            f"(`attach_flags()`) to have them verified"
        )

    # ---- WeightReceiver --------------------------------------------------------------------
    def check_refit(self, specs: list[dict], accept: dict[str, str] | None = None) -> dict:
        """The trainer's tensors against the checkpoint the server was started from; then the
        staging checkpoint is laid out (nothing reaches the engine)."""
        wanted = specs_from_dicts(specs)
        check_against_checkpoint(wanted, self.model_path, engine_dtype=None, name=self.engine_name)
        sent = {s.name for s in wanted}
        # What the trainer does not send (a tied head stored twice) keeps the checkpoint's value.
        kept = [s for n, s in checkpoint_specs(self.model_path).items() if n not in sent]
        self._close_staging()
        folder = tempfile.mkdtemp(prefix="weightsync-stock-", dir=self.staging_dir)
        staged = StagedCheckpoint(folder, wanted + kept, self.model_path)
        staged.fill_from(self.model_path, [s.name for s in kept])
        module = _module_of(staged.tensors)
        params = dict(module.named_parameters())

        def load_fn(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
            names = []
            for name, tensor in pairs:
                getattr(params[name], "weight_loader", copy_loader)(params[name], tensor)
                names.append(name)
            return names

        receiver = ModelReceiver(
            module, load_fn=load_fn, default_loader=copy_loader, name=self.engine_name
        )
        receiver.buckets.plain_copies = True
        answer = receiver.check_refit(wanted)
        self._staged, self._receiver = staged, receiver
        return replace(answer, tp_size=self.tp_size, unverifiable=self.unverifiable).to_dict()

    def _staging(self) -> ModelReceiver:
        if self._receiver is None:
            raise RuntimeError(f"{self.engine_name}: no refit check yet; connect first")
        return self._receiver

    def _engine_begin(self, one_copy: bool | list[str]) -> str | None:
        self._staging().open_update()
        if one_copy:
            return f"{self.engine_name}: a stock engine has no one-copy path"
        return None

    def _engine_load(self, descriptor: dict) -> LoadReport:
        report, _ = self._staging().load_bucket(
            BucketDescriptor.from_dict(descriptor), learn_placements=False
        )
        return report

    def _engine_end(self, version: str) -> EndReport:
        if self._staged is None:
            raise RuntimeError(f"{self.engine_name}: no staged checkpoint; connect first")
        flushed = self._reload(self._staged.folder, version)  # sets `_reloading` as it starts
        self._reloading = False
        return EndReport(weight_version=version, cache_flushed=flushed)

    def _engine_abort(self, reason: str) -> bool:
        # The engine's weights change only inside its reload: an update aborted before that
        # leaves it whole; one whose reload failed may have left it half loaded.
        mixed, self._reloading = self._reloading, False
        return mixed

    def _engine_stage(self) -> StageReport:
        raise RuntimeError(self.unverifiable)

    def fingerprints(self) -> dict[str, list[int]]:
        raise RuntimeError(self.unverifiable)

    def set_keep_previous(self, on: bool) -> None:
        """Nothing to keep: the engine's weights change only inside its own reload, at `end`."""

    @abstractmethod
    def _reload(self, folder: str, version: str) -> bool:
        """Have the engine load the checkpoint in `folder` as `version`, with requests in flight
        finished on the old weights and new ones held until it is done, and its prefix cache
        reset; whether the cache was reset. Sets `_reloading` once the engine's weights may
        change (a failure before that leaves it serving its previous weights)."""

    def _close_staging(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._staged is not None:
            shutil.rmtree(self._staged.folder, ignore_errors=True)
        self._staged = self._receiver = None

    def staged_folder(self) -> str | None:
        """The staging checkpoint's folder (None before connect)."""
        return None if self._staged is None else self._staged.folder

    def shutdown(self) -> None:
        """Remove the staged checkpoint; the server is its owner's and keeps running."""
        self._close_staging()
