"""The reference receiver: a `WeightReceiver` for a plain torch module in the caller's process
(tests, benches, and engines of one's own), over the same `ModelReceiver` the engines use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from weightsync.engine.refit import copy_loader
from weightsync.engine.replica import ModelReceiver, sharing_of
from weightsync.engine.session import WeightReceiver
from weightsync.wire.protocol import (
    BeginAnswer,
    EndReport,
    StageReport,
)
from weightsync.wire.specs import BucketDescriptor, specs_from_dicts

if TYPE_CHECKING:
    import torch
    from torch import nn


def _fused_loader(param: torch.Tensor, loaded: torch.Tensor, start: int) -> None:
    """Copy `loaded` into `param`'s elements from `start` on (one of a fused parameter's
    members)."""
    if start + loaded.numel() > param.numel():
        raise ValueError(
            f"{tuple(loaded.shape)} from element {start} overruns a parameter of "
            f"{param.numel()} elements"
        )
    param.data.view(-1)[start : start + loaded.numel()].copy_(loaded.reshape(-1))


class ModuleWeightReceiver(WeightReceiver):
    """A `WeightReceiver` for a plain torch module whose parameters carry the senders' names.

    The reference receiver: what an engine's loader does, with nothing engine-specific (used by
    the core tests and the GPU transport benchmarks).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str = "module",
        sliced: bool = False,
        fused: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        """`sliced`: the parameters' loaders keep a slice of each tensor (a tensor-parallel
        worker's): the receiver learns its placements and reports them at `end`. `fused`:
        where the loader puts tensors, as engines fuse q/k/v or experts into one parameter
        ({tensor: (parameter, first element)}, weightsync/apps/layouts.py `fused`, which lists every
        tensor, an unfused one at element 0 of its own parameter)."""
        self.sliced = sliced
        params = dict(model.named_parameters())
        fused = fused or {}
        # As an engine's fused parameters carry their loader (an attribute torch's Parameter
        # type does not declare; the refit check wraps it).
        for into, _ in fused.values():
            params[into].weight_loader = _fused_loader  # type: ignore[attr-defined]

        def load_fn(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for pname, tensor in weights:
                if pname in fused:
                    into, start = fused[pname]
                    target = params[into]
                    target.weight_loader(target, tensor, start)  # type: ignore[attr-defined]
                    continue
                param = params.get(pname)
                if param is not None:
                    getattr(param, "weight_loader", copy_loader)(param, tensor)

        self.receiver = ModelReceiver(model, load_fn=load_fn, default_loader=copy_loader, name=name)
        # load_fn hands each unfused tensor to the parameter of its name: plain copies may be
        # batched.
        self.receiver.buckets.plain_copies = not fused
        self._version: str | None = None
        self._session: str | None = None
        self._one_copy = False

    def check_refit(self, specs: list[dict]) -> dict:
        return self.receiver.check_refit(specs_from_dicts(specs)).to_dict()

    def begin(self, version: str, one_copy: bool | list[str] = False) -> dict:
        if self._session is not None:
            raise RuntimeError(f"update session {self._session!r} is still open")
        if one_copy:
            why = self.receiver.begin_one_copy(keep_previous=False, sharing=sharing_of(one_copy))
            if why is not None:
                return BeginAnswer(one_copy=False, why=why).to_dict()
        self._session, self._one_copy = version, bool(one_copy)
        return BeginAnswer(one_copy=bool(one_copy)).to_dict()

    def share_params(self) -> dict:
        return self.receiver.share().to_dict()

    def load_bucket(self, descriptor: dict) -> dict:
        bucket = BucketDescriptor.from_dict(descriptor)
        if self._session is None:
            raise RuntimeError("load_bucket outside an update session; call begin first")
        report, _ = self.receiver.load_bucket(bucket, learn_placements=self.sliced)
        return report.to_dict()

    def end(self, version: str) -> dict:
        if self._session != version:
            raise RuntimeError(f"end({version!r}) but the open session is {self._session!r}")
        if self._one_copy:
            self.receiver.end_one_copy()
        self._session = None
        self._version = version
        placements: list[dict[str, Any]] | None = (
            [self.receiver.placements] if self.sliced else None
        )
        return EndReport(weight_version=version, placements=placements).to_dict()

    def abort(self, reason: str) -> None:
        self._session = None

    def stage(self, version: str) -> dict:
        if self._session != version:
            raise RuntimeError(f"stage({version!r}) but the open session is {self._session!r}")
        placements = [self.receiver.placements] if self.sliced else None
        return StageReport(
            fingerprints=[self.receiver.fingerprints()], placements=placements
        ).to_dict()

    def fingerprints(self) -> dict[str, list[int]]:
        return self.receiver.fingerprints()

    def worker_fingerprints(self) -> list[dict[str, list[int]]]:
        return [self.receiver.fingerprints()]

    def weight_version(self) -> str | None:
        return self._version
