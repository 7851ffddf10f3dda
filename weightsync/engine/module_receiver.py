"""The reference receiver: a `WeightReceiver` for a plain torch module in the caller's process
(tests, benches, and engines of one's own), over the same `ModelReceiver` the engines use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from weightsync.engine.inbox import PointToPointInbox
from weightsync.engine.refit import copy_loader
from weightsync.engine.replica import ModelReceiver, sharing_of
from weightsync.engine.session import EngineSession
from weightsync.wire.probe import Decoded, greedy_causal_lm, score_causal_lm
from weightsync.wire.protocol import (
    EndReport,
    LoadReport,
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


class ModuleWeightReceiver(EngineSession):
    """A `WeightReceiver` for a plain torch module whose parameters carry the senders' names.

    The reference receiver: what an engine's loader does, with nothing engine-specific (used by
    the core tests and the GPU transport benchmarks). It follows the update-session rules of
    every engine actor (`EngineSession`) and receives through the same `ModelReceiver`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str = "module",
        sliced: bool = False,
        fused: dict[str, tuple[str, int]] | None = None,
        idle_timeout_s: float = 60.0,
    ) -> None:
        """`sliced`: the parameters' loaders keep a slice of each tensor (a tensor-parallel
        worker's): the receiver learns its placements and reports them at `end`. `fused`:
        where the loader puts tensors, as engines fuse q/k/v or experts into one parameter
        ({tensor: (parameter, first element)}, weightsync/apps/layouts.py `fused`, which lists
        every tensor, an unfused one at element 0 of its own parameter). `idle_timeout_s`: as
        `EngineSession`'s."""
        super().__init__(idle_timeout_s=idle_timeout_s)
        self.engine_name = name
        self.sliced = sliced
        params = dict(model.named_parameters())
        fused = fused or {}
        self._fused = fused
        # With `fused`, where each tensor lies is known, not learned: reported as placements
        # (a whole tensor at its first element) once the refit check gave the tensors' sizes.
        self._given: dict[str, Any] | None = None
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

        # One process receives for this engine, and its load reports go back whole.
        self.receiver = ModelReceiver(
            model,
            load_fn=load_fn,
            default_loader=copy_loader,
            name=name,
            answers_reach_sender=True,
        )
        # load_fn hands each unfused tensor to the parameter of its name: plain copies may be
        # batched; a replayed bucket's fused or sliced tensors are copied where the loader put
        # them (`BucketLoader.placed`: given with `fused`, learned with `sliced`).
        self.receiver.buckets.plain_copies = not fused
        if sliced:
            self.receiver.buckets.placed = self.receiver.placements
        self.inbox = PointToPointInbox(self.receiver, name=name)

    def check_refit(self, specs: list[dict], accept: dict[str, str] | None = None) -> dict:
        parsed = specs_from_dicts(specs)
        answer = self.receiver.check_refit(parsed).to_dict()
        if self._fused:
            self._given = {}
            for spec in parsed:
                if spec.name in self._fused:
                    into, start = self._fused[spec.name]
                    self._given[spec.name] = [into, [[start, 0, spec.numel, 1, 0, 0]]]
            self.receiver.buckets.placed = self._given
        return answer

    def _engine_begin(self, one_copy: bool | list[str]) -> str | None:
        self.receiver.open_update()
        if not one_copy:
            return None
        return self.receiver.begin_one_copy(keep_previous=False, sharing=sharing_of(one_copy))

    def _engine_share(self) -> dict:
        return self.receiver.share().to_dict()

    def _engine_load(self, descriptor: dict) -> LoadReport:
        bucket = BucketDescriptor.from_dict(descriptor)
        report, _ = self.receiver.load_bucket(bucket, learn_placements=self.sliced)
        return report

    def _placements(self) -> list[dict[str, Any]] | None:
        if self._given is not None:
            return [self._given]
        return [self.receiver.placements] if self.sliced else None

    def _engine_end(self, version: str) -> EndReport:
        if self._one_copy:
            self.receiver.end_one_copy()
        self.receiver.buckets.settle()  # every bucket's copies written before the update ends
        return EndReport(weight_version=version, placements=self._placements())

    def p2p_support(self) -> str | None:
        if not self.sliced and self._given is None and not self._fused:
            return (
                f"{self.engine_name}: the receiver learns no placements (make it with "
                f"sliced=True or fused=...), so the trainer cannot plan what it keeps"
            )
        return None

    def _engine_p2p_open(
        self, plan: dict, first_worker: int, host: str, port: int, backend: str, timeout_s: float
    ) -> str | None:
        placements = self._placements()
        return self.inbox.open(
            plan,
            first_worker,
            placements[0] if placements else {},
            host=host,
            port=port,
            backend=backend,
            timeout_s=timeout_s,
        )

    def _engine_p2p_receive(self) -> LoadReport:
        return self.inbox.receive()

    def _engine_abort(self, reason: str) -> bool:
        # No previous weights are kept: once a bucket landed (or the trainer began writing
        # into the shared parameters) the module may hold two versions.
        self.receiver.buckets.settle()  # no copy still reads the sender's buckets
        return self._loaded > 0

    def _engine_stage(self) -> StageReport:
        return StageReport(
            fingerprints=[self.receiver.fingerprints()], placements=self._placements()
        )

    def _engine_probe(self, tokens: list[list[int]]) -> list[list[float]]:
        """The module's own forward (a causal LM: `model(input_ids=...)` gives logits)."""
        return score_causal_lm(self.receiver.model, tokens)

    def _engine_probe_decode(self, tokens: list[list[int]], steps: int) -> list[Decoded]:
        """The module's forward again for each step (it keeps no KV cache)."""
        return greedy_causal_lm(self.receiver.model, tokens, steps)

    def fingerprints(self) -> dict[str, list[int]]:
        return self.receiver.fingerprints()

    def worker_fingerprints(self) -> list[dict[str, list[int]]]:
        return [self.receiver.fingerprints()]
