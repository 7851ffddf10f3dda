"""Keeping the previous weights during an update, inside an engine's model process.

An engine that keeps them (SGLang or vLLM with `keep_previous=True`) copies every parameter an update is
about to overwrite, once per update, and puts the copies back when the update is aborted: it
goes on serving the previous version instead of refusing requests until the next sync. It costs
one copy of what an update touches, held only while the update is open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from weightsync.engine.refit import RefitCheck


class PreviousWeights:
    """Copies of the parameters the open update has overwritten so far (none outside one)."""

    def __init__(self, model: nn.Module, refit: RefitCheck, *, name: str = "engine") -> None:
        self.model = model
        self.refit = refit
        self.name = name
        self._saved: dict[str, torch.Tensor] | None = None

    def keep(self, names: list[str]) -> None:
        """Before trainer tensors `names` are loaded: copy the parameters they land in (each
        once per update)."""
        if self._saved is None:
            self._saved = {}
        params = dict(self.model.named_parameters())
        for name in names:
            targets = self.refit.param_of.get(name)
            if targets is None:
                raise RuntimeError(
                    f"{self.name}: cannot keep the previous weights of {name!r}: "
                    f"its parameters are unknown (check_refit first)"
                )
            for pname in targets:
                if pname not in self._saved:
                    self._saved[pname] = params[pname].detach().clone()

    def keep_all(self, params: dict[str, torch.Tensor]) -> None:
        """Before the trainer writes into `params` (the one-copy path), or before tensors whose
        parameters are not known yet are loaded: copy those not copied yet in this update."""
        if self._saved is None:
            self._saved = {}
        for pname, param in params.items():
            if pname not in self._saved:
                self._saved[pname] = param.detach().clone()

    def restore(self, *, fence: bool = False) -> int:
        """Put back what this update overwrote; how many parameters that was. With `fence`,
        each parameter takes its copy as its memory instead of having it copied back: whoever
        still writes into the memory the parameter had no longer reaches it."""
        saved, self._saved = self._saved or {}, None
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for pname, copy in saved.items():
                if fence:
                    params[pname].data = copy
                else:
                    params[pname].copy_(copy)
        return len(saved)

    def drop(self) -> None:
        """The update is complete: forget the copies."""
        self._saved = None
