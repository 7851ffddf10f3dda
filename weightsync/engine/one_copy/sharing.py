"""The engine side of the one-copy path (weightsync/trainer/one_copy/targets.py): sharing a model's parameters.

Once a first sync by buckets has shown where every trainer tensor lands, the engine probes its
loader and moves the parameters into shared memory; from then on each update checks, before the
trainer writes and again at its end, that the parameters still are where the trainer writes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from weightsync.engine.one_copy.segment import SharedParameters, probe_destinations
from weightsync.wire.errors import NotShared
from weightsync.wire.protocol import ShareAnswer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from weightsync.engine.refit import LoadFn, RefitCheck

logger = logging.getLogger(__name__)


class ParameterSharing:
    """Whether one model replica's parameters are shared with the trainer, and where."""

    def __init__(
        self, model: nn.Module, refit: RefitCheck, *, load_fn: LoadFn, name: str = "engine"
    ) -> None:
        self.model = model
        self.refit = refit
        self.load_fn = load_fn
        self.name = name
        self.shared: Any = None  # SharedParameters (CPU) or CudaParameters (GPU)
        # Where each shared parameter is registered (its module's _parameters, key), in the
        # shared parameters' order: the checks look at what is registered there now, so a new
        # Parameter object in its own memory counts as moved.
        self._homes: tuple[list[dict], list[str]] = ([], [])

    def share(
        self,
        placements: dict[str, Any] | None = None,
        known: dict[str, tuple[str, int]] | None = None,
    ) -> ShareAnswer:
        """Share the parameters for the trainer to write (CPU: moved into a shared-memory
        segment; GPU: their CUDA storages exported, weightsync/engine/one_copy/cuda_exports.py);
        once, after a first sync by buckets (the loader must have shown where every tensor
        goes). `placements` (weightsync/wire/placement.py), from a tensor-parallel worker:
        which elements of each tensor it holds and where; the trainer then writes each tensor
        through its patterns. `known`: {tensor: (parameter, byte offset)} already learned from
        the loader (whole verbatim placements): those tensors are not probed again."""
        if self.shared is not None:
            try:
                self._check()
                return ShareAnswer(shared=self.shared.describe())
            except NotShared:
                self.shared.close()
                self.shared = None
        accepted, param_of = self.refit.accepted, self.refit.param_of
        unknown = sorted(set(accepted) - set(param_of))
        if not accepted or unknown:
            return ShareAnswer(
                shared=None,
                retry=True,
                why=f"{self.name}: where {len(unknown)} tensor(s) land is not "
                f"known yet (sync by buckets first)",
            )
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        if placements is None:
            known = {n: d for n, d in (known or {}).items() if n in accepted and d[0] in params}
            destinations = dict(known)
            destinations |= probe_destinations(
                params,
                {n: t for n, t in param_of.items() if n not in known},
                accepted,
                lambda name, tensor: self.load_fn(iter([(name, tensor)])),
                lambda pairs: self.load_fn(iter(pairs)),
            )
        else:
            destinations = {name: (pname, 0) for name, (pname, _) in placements.items()}
        indirect = sorted(set(accepted) - set(destinations))
        if indirect:
            return ShareAnswer(
                shared=None,
                why=f"{self.name}: the loader does not copy {len(indirect)} "
                f"tensor(s) verbatim into one parameter, e.g. {indirect[:3]}",
            )
        devices = {params[p].device.type for p, _ in destinations.values()}
        if devices == {"cuda"}:
            from weightsync.engine.one_copy.cuda_exports import CudaParameters

            self.shared = CudaParameters(params, destinations, placements=placements)
        elif devices == {"cpu"}:
            self.shared = SharedParameters(params, destinations, placements=placements)
        else:
            return ShareAnswer(
                shared=None,
                why=f"{self.name}: parameters on {sorted(devices)}; "
                f"the one-copy path needs all on the CPU or all "
                f"on GPUs",
            )
        homes = [self._home(n) for n in self.shared.params]
        self._homes = ([h[0] for h in homes], [h[1] for h in homes])
        logger.info(
            "%s: %d parameters shared: %s", self.name, len(self.shared.params), self.shared.label
        )
        return ShareAnswer(shared=self.shared.describe())

    def _home(self, pname: str) -> tuple[dict, str]:
        prefix, _, attr = pname.rpartition(".")
        return self.model.get_submodule(prefix)._parameters, attr

    def _check(self) -> None:
        """Raise `NotShared` unless every parameter registered where a shared one was still
        lives where the trainer writes (a new Parameter object in its own memory does not)."""
        tables, keys = self._homes
        self.shared.check(list(map(dict.get, tables, keys)))

    def begin(self, sharing: list[str] | None = None) -> str | None:
        """Before the trainer writes: None if the parameters are where it will write, else
        why not. `sharing`: the sharings the trainer holds mapped (the segment names or CUDA
        export owners its engine's workers described; None: whatever is shared now). One of
        them must be this one: after the parameters were shared again (they moved, or an update
        fenced them off, e.g. another trainer's rolled-back update) a trainer still holding the
        old sharing would write into memory the engine no longer computes with, and read its own
        bytes back from there. (Sharing for a second trainer while nothing moved hands out the
        same sharing.)"""
        if self.shared is None:
            return f"{self.name}: parameters are not shared"
        if sharing is not None and self.shared.token not in sharing:
            return (
                f"{self.name}: the trainer writes into {sharing} but the parameters are now "
                f"shared as {self.shared.token!r} (shared again since they moved or were "
                f"fenced off); this update takes "
                f"buckets, then the trainer maps the new sharing"
            )
        try:
            self._check()
        except NotShared as exc:
            return str(exc)
        return None

    def params(self) -> list[str]:
        """Names of the shared parameters (the ones the trainer writes into)."""
        return sorted(self.shared.params) if self.shared is not None else []

    def end(self) -> None:
        """After the trainer wrote: raise `NotShared` unless every shared parameter still is
        the bytes it wrote (something may have replaced one meanwhile)."""
        if self.shared is None:
            raise NotShared(f"{self.name}: parameters are not shared")
        self._check()

    def release(self) -> None:
        """The parameters left the shared segment (fenced off from writers): forget it. The
        next sync goes by buckets, then the parameters are shared again."""
        if self.shared is not None:
            logger.warning("%s: parameters fenced off from %s", self.name, self.shared.label)
            self.shared.close()
            self.shared = None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def combine_worker_shares(answers: list[ShareAnswer]) -> ShareAnswer:
    """One engine's `share_params` answer from its workers' `ParameterSharing.share` answers:
    one worker's as it is; several as `shared=[each worker's]` when every worker shared its
    parameters, else the first reason why not (the trainer writes into all workers or none)."""
    if len(answers) == 1:
        return answers[0]
    missing = [a for a in answers if not a.shared]
    if missing:
        return ShareAnswer(shared=None, why=missing[0].why, retry=any(a.retry for a in missing))
    shared = []
    for rank, answer in enumerate(answers):
        if not isinstance(answer.shared, dict):
            raise RuntimeError(
                f"worker {rank}'s share answer holds a {type(answer.shared).__name__}, not the "
                f"dict describing its own shared parameters; each worker answers for itself"
            )
        shared.append(answer.shared)
    return ShareAnswer(shared=shared)
