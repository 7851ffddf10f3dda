"""Refit checking, inside an engine's model process: will the engine accept the trainer's tensors?

Checked once per trainer, before any sync, so that nothing is written into an engine whose model
does not fit. The result, `RefitCheck.accepted` (the trainer's tensors by name) and
`RefitCheck.param_of` (which engine parameters each trainer tensor lands in), is what loading,
keeping the previous weights, the one-copy path and verification work from.

How the dry run works: engines load a tensor by calling `param.weight_loader(param, tensor, ...)`
(or a default loader when the parameter has none). During a check every parameter's loader is
wrapped so the call is recorded (which incoming name reached which parameter) and redirected to
an empty scratch copy of the parameter, so the engine's shape logic runs and raises where a
shape does not fit, yet no engine weight changes. The recorded map also tells verification which
trainer tensors make up each engine parameter. Engines whose loader cannot be dry-run (vLLM's)
are checked against the checkpoint they were started from instead (`check_against_checkpoint`)
and learn `param_of` while loading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from weightsync.wire.protocol import RefitAnswer
from weightsync.wire.specs import TensorSpec, dtype_from_str, dtype_to_str

if TYPE_CHECKING:
    from torch import nn

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
"""The engine's own `model.load_weights`: takes (trainer name, tensor) pairs."""
WeightLoader = Callable[..., Any]
"""A parameter's `weight_loader(param, tensor, ...)`, or the engine's default loader."""


def copy_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The plainest engine loader: shapes must match exactly."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _scratch_like(param: torch.Tensor) -> torch.nn.Parameter:
    scratch = torch.nn.Parameter(torch.empty_like(param.data), requires_grad=False)
    for key, value in vars(param).items():
        if key != "weight_loader":
            setattr(scratch, key, value)
    return scratch


class RefitCheck:
    """The trainer's tensors this model replica accepted, and where each one lands.

    `load_fn` is the engine's own `model.load_weights`; `default_loader` is the engine's loader
    for parameters that carry no `weight_loader` of their own.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        load_fn: LoadFn,
        default_loader: WeightLoader,
        name: str = "engine",
    ) -> None:
        self.model = model
        self.load_fn = load_fn
        self.default_loader = default_loader
        self.name = name
        self.accepted: dict[str, TensorSpec] = {}
        self.param_of: dict[str, list[str]] = {}

    @contextmanager
    def _traced_loaders(self, *, dry_run: bool) -> Iterator[dict[str, Any]]:
        """Wrap every parameter's loader; yields the trace state {"current": name, "hits": {}}."""
        state: dict[str, Any] = {"current": None, "hits": {}}
        params = dict(self.model.named_parameters())
        saved: dict[str, tuple[bool, Any]] = {}

        def make(pname: str, original: WeightLoader) -> WeightLoader:
            def traced(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any):
                incoming = state["current"]
                state["hits"].setdefault(incoming, [])
                if pname not in state["hits"][incoming]:
                    state["hits"][incoming].append(pname)
                target = _scratch_like(param) if dry_run else param
                return original(target, loaded, *args, **kwargs)

            return traced

        try:
            for pname, param in params.items():
                has = "weight_loader" in vars(param)
                original = vars(param).get("weight_loader", self.default_loader)
                saved[pname] = (has, vars(param).get("weight_loader"))
                # An engine's attribute, not torch's (vLLM's parameters make it a property).
                param.weight_loader = make(pname, original)  # type: ignore[attr-defined]
            yield state
        finally:
            for pname, (has, original) in saved.items():
                param = params[pname]
                if has:
                    param.weight_loader = original  # type: ignore[attr-defined]
                else:
                    del param.weight_loader  # type: ignore[attr-defined]

    def _feed(
        self, state: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            state["current"] = name
            yield name, tensor

    def check(self, specs: list[TensorSpec]) -> RefitAnswer:
        """Dry-run the engine's loader on empty tensors of the trainer's specs; see module doc.
        Raises ValueError naming the first misfit."""
        if not specs:
            raise ValueError(f"{self.name}: the trainer offers no tensors (an empty model?)")
        params = dict(self.model.named_parameters())
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            dup = sorted({s.name for s in specs if sum(t.name == s.name for t in specs) > 1})
            raise ValueError(f"{self.name}: tensors named twice in refit info: {dup}")

        # Materialising tensors happens lazily, one at a time, inside the engine's loader.
        def empties() -> Iterator[tuple[str, torch.Tensor]]:
            for spec in specs:
                yield spec.name, torch.zeros(spec.shape, dtype=dtype_from_str(spec.dtype))

        with self._traced_loaders(dry_run=True) as state:
            try:
                self.load_fn(self._feed(state, empties()))
            except Exception as exc:  # the engine's loader rejected a tensor
                name = state["current"]
                spec = by_name.get(name)
                targets = state["hits"].get(name) or []
                shapes = ", ".join(f"{p} {tuple(params[p].shape)}" for p in targets if p in params)
                raise ValueError(
                    f"{self.name}: tensor {name!r} (trainer shape "
                    f"{spec.shape if spec else '?'}, dtype {spec.dtype if spec else '?'}) was "
                    f"rejected by the engine's loader"
                    + (f" for engine parameter {shapes}" if shapes else "")
                    + f": {type(exc).__name__}: {exc}"
                ) from None
        hits: dict[str, list[str]] = {k: v for k, v in state["hits"].items() if k is not None}
        missing = [s.name for s in specs if s.name not in hits]
        if missing:
            raise ValueError(
                f"{self.name}: the engine's model has no parameter for {len(missing)} trainer "
                f"tensor(s), e.g. {missing[:5]}; check the model architecture and HF naming"
            )
        for spec in specs:
            for pname in hits[spec.name]:
                engine_dtype = dtype_to_str(params[pname].dtype)
                if engine_dtype != spec.dtype:
                    raise ValueError(
                        f"{self.name}: tensor {spec.name!r}: trainer dtype {spec.dtype} != "
                        f"engine dtype {engine_dtype} (parameter {pname!r}); send "
                        f"{engine_dtype} (the worker's dtype= option)"
                    )
        covered = {p for targets in hits.values() for p in targets}
        uncovered = sorted(set(params) - covered)
        if uncovered:
            raise ValueError(
                f"{self.name}: {len(uncovered)} engine parameter(s) would get no trainer tensor, "
                f"e.g. {uncovered[:5]}; a sync would leave them stale"
            )
        self.accepted = by_name
        self.param_of = hits
        return RefitAnswer(param_of=hits, num_params=len(params))

    def accept(self, specs: list[TensorSpec]) -> None:
        """Accept `specs` checked without a dry run (`check_against_checkpoint`); `param_of`
        is then filled in by whoever loads, as it learns where each tensor lands."""
        self.accepted = {s.name: s for s in specs}


SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
"""weightsync's dtype names -> the dtype codes of a safetensors header."""


def checkpoint_specs(path: str) -> dict[str, TensorSpec]:
    """Name, dtype and shape of every tensor in a safetensors checkpoint directory (headers
    only; nothing is loaded)."""
    import glob

    from safetensors import safe_open

    dtypes = {code: name for name, code in SAFETENSORS_DTYPES.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}; cannot check refit info")
    specs: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                specs[name] = TensorSpec(
                    name=name,
                    dtype=dtypes.get(piece.get_dtype(), "?"),
                    shape=tuple(piece.get_shape()),
                )
    return specs


def _unties_head(path: str) -> bool:
    """Whether the checkpoint's config.json unties the LM head from the embedding (its
    `tie_word_embeddings`, or its `text_config`'s, is false); where it says nothing the head
    counts as tied, transformers' default."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    for part in (config, config.get("text_config") or {}):
        if "tie_word_embeddings" in part:
            return part["tie_word_embeddings"] is False
    return False


def check_against_checkpoint(
    specs: list[TensorSpec], path: str, *, engine_dtype: str | None, name: str = "engine"
) -> None:
    """Refit check for engines without a dry run: the trainer's tensors must be the ones the
    engine was started from (same names and shapes), in the engine's dtype (`engine_dtype`
    None: each in the checkpoint's own dtype, for an engine that loads a checkpoint and casts
    as it did at start)."""
    known = checkpoint_specs(path)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"{name}: tensor {spec.name!r} appears twice in refit info")
        seen.add(spec.name)
        ref = known.get(spec.name)
        if ref is None:
            raise ValueError(
                f"{name}: the engine's model has no parameter for trainer tensor "
                f"{spec.name!r}; check the model architecture and HF naming"
            )
        if ref.shape != spec.shape:
            raise ValueError(
                f"{name}: tensor {spec.name!r}: trainer shape {spec.shape} != "
                f"engine shape {ref.shape}"
            )
        if engine_dtype is None and spec.dtype != ref.dtype:
            raise ValueError(
                f"{name}: tensor {spec.name!r}: trainer dtype {spec.dtype} != checkpoint dtype "
                f"{ref.dtype}; send {ref.dtype}, the dtype of the checkpoint the engine was "
                f"started from (it casts what it loads as it did at start)"
            )
        if engine_dtype is not None and spec.dtype != engine_dtype:
            raise ValueError(
                f"{name}: tensor {spec.name!r}: trainer dtype {spec.dtype} != "
                f"engine dtype {engine_dtype}; send {engine_dtype} (the worker's "
                f"dtype= option)"
            )
    # A tied head is not sent (the engine loads the embedding into it); an untied engine's
    # head must be, or no sync would ever reach it.
    untied = _unties_head(path)
    if untied and "lm_head.weight" in known and "lm_head.weight" not in seen:
        raise ValueError(
            f"{name}: engine tensor 'lm_head.weight' would get no trainer tensor: the engine's "
            f"checkpoint unties the LM head from the embedding (tie_word_embeddings false in "
            f"{os.path.join(path, 'config.json')}) but the trainer ties them and sends only the "
            f"embedding; untie the trainer's model (tie_word_embeddings=False) or start the "
            f"engine from a tied checkpoint"
        )
    missing = sorted(set(known) - seen - {"lm_head.weight"})
    if missing:
        raise ValueError(
            f"{name}: {len(missing)} engine tensor(s) would get no trainer tensor, "
            f"e.g. {missing[:5]}; a sync would leave them stale"
        )
    if not specs:
        raise ValueError(f"{name}: the trainer offers no tensors (an empty model?)")


def refuse_forms(engine: str, forms: list[tuple[str, str]], accept: Mapping[str, str]) -> list[str]:
    """Raise ValueError naming the first of `forms` ((kind, why): a layer whose form after
    loading a sync cannot keep in step) whose kind `accept` ({kind: reason},
    `SyncOptions.accept_unkept`) does not name, and the opt-in; else each form, with its reason
    (empty: none)."""
    refused = [(kind, why) for kind, why in forms if kind not in accept]
    if refused:
        kind, why = refused[0]
        raise ValueError(
            f"{engine}: {len(refused)} layer(s) refused: {why}. To serve it as it was when the "
            f"engine started, whatever the syncs write, accept it with a reason: "
            f"SyncOptions(accept_unkept={{{kind!r}: 'why that is right for this model'}})"
        )
    return [f"{why} (accepted: {accept[kind]})" for kind, why in forms]


def combine_refit_answers(answers: list[dict], *, who: str, tp_size: int) -> dict:
    """One engine's `check_refit` answer from each of its `who`s' ("worker", "scheduler"), in
    rank order: the first's, with how many receivers a sync reaches, the engine's TP size and
    every one's accepted forms, each named by its rank."""
    first = RefitAnswer.from_dict(answers[0])
    accepted = [
        f"{who} {rank}: {form}"
        for rank, answer in enumerate(answers)
        for form in answer.get("accepted") or []
    ]
    return replace(
        first, num_receivers=len(answers), tp_size=tp_size, accepted=accepted or None
    ).to_dict()
