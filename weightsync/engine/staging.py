"""A second copy of a model's parameters that a staged update loads into, inside an engine's
model process, while the model serves the first (`begin(..., staged=True)`).

The model keeps computing with its parameters; for the length of each load (one engine call,
which an engine runs between its forward steps) every parameter is pointed at its staged copy
(`loading`), so the engine's own loaders, placements and fingerprints work unchanged and write
or read the copy. `switch` copies what the update wrote into the served parameters in place:
their memory does not move, so whatever points at it (CUDA graphs, packed-GEMM wrappers) stays
valid. It costs one copy of the parameters, held from the first staged update on (`nbytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

Write = Callable[[str, torch.Tensor, torch.Tensor], None]
"""(parameter name, destination, source): copy source's values into destination."""


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class StagedWeights:
    """One model's staged copy of its parameters (see the module doc). `current`: the copy
    equals the served parameters (true after `refresh` and after `switch`; whatever else
    writes the parameters must call `stale`)."""

    def __init__(self, model: nn.Module, *, name: str = "engine") -> None:
        self.model = model
        self.name = name
        self.current = False
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        """Bytes the staged copy holds."""
        return sum(copy.numel() * copy.element_size() for _, _, copy in self._pairs)

    @torch.no_grad()
    def refresh(self, read: Write = _copy) -> None:
        """Make the copy equal the served parameters (allocated on first use): `read(name,
        copy, parameter)` writes each parameter's values into its copy."""
        named = list(self.model.named_parameters())
        if len(named) != len(self._pairs) or any(
            p is not q or n != m for (n, p), (m, q, _) in zip(named, self._pairs)
        ):  # first use, or the model's parameters were replaced (a reload)
            self._pairs = [(name, param, torch.empty_like(param.data)) for name, param in named]
        for name, param, copy in self._pairs:
            read(name, copy, param.data)
        self.current = True

    def stale(self) -> None:
        """The served parameters were written otherwise: `refresh` before the next staged
        update."""
        self.current = False

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Every parameter points at its staged copy until the block ends (nothing may compute
        with the model meanwhile)."""
        if not self._pairs:
            raise RuntimeError(f"{self.name}: staged load before the staged copy was made")
        served = [param.data for _, param, _ in self._pairs]
        try:
            for _, param, copy in self._pairs:
                param.data = copy
            yield
        finally:
            for (_, param, _), data in zip(self._pairs, served):
                param.data = data

    @torch.no_grad()
    def switch(self, names: set[str], write: Write = _copy) -> float:
        """The served parameters `names` take the staged values, in place (`write(name,
        parameter, copy)`); seconds it took. The copy is then current."""
        unknown = names - {name for name, _, _ in self._pairs}
        if unknown:
            raise ValueError(
                f"{self.name}: the staged update wrote {sorted(unknown)[:3]}, which are not "
                f"parameters of the staged copy; nothing was switched"
            )
        start = time.perf_counter()
        for name, param, copy in self._pairs:
            if name in names:
                write(name, param.data, copy)
        self.current = True
        return time.perf_counter() - start
