"""Tensors SGLang derives from loaded weights after loading, kept in step with syncs (runs inside
SGLang's scheduler process).

SGLang's DeepSeek-family models (DeepSeek-V2/V3, Kimi-K2, GLM and the like) end every
`load_weights` with `post_load_weights`, which derives each MLA attention layer's `w_kc` /
`w_vc` (the key and value halves of `kv_b_proj.weight` per head, as the decode's batched GEMMs
read them) and writes them in place. No checkpoint or trainer tensor lands in them, so a sync
that does not run the loader (a replayed bucket, a one-copy sync) leaves them on the previous
weights, and a load the sync makes for its own purposes (placements learned on scratch copies)
would derive them from that scratch. `PostLoadTensors` holds the model's own post-load step
back inside every load of the sync (`held`), runs it once after the update wrote the served
parameters and before the engine serves or is verified (`derive`), checks what it derived
against an independent derivation (`stale`: a sync fails on any), and at connect refuses,
naming the layer, what it cannot derive again exactly: a quantized `kv_b_proj` (SGLang
requantizes it there, which does not repeat), DeepGEMM's batched GEMMs, ROCm, Ascend and MUSA
forms, query replication across decode context parallelism, and a model whose post-load step
derives tensors weightsync does not know.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

DERIVED = ("w_kc", "w_vc")  # each MLA layer's attributes, in that order


def _skip(*args: Any, **kwargs: Any) -> None:
    """The model's post-load step while a sync's load holds it back."""


class PostLoadTensors:
    """The tensors one SGLang model derives after loading (none for most models)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.derives = callable(getattr(type(model), "post_load_weights", None))
        self.layers: list[tuple[str, Any]] = []  # (module name, MLA attention layer)
        # (kind, why) the model's derived tensors cannot be kept in step (`refuse`)
        self.refused: list[tuple[str, str]] = []
        if not self.derives:
            return
        fix = (
            "weightsync cannot derive them again after a sync; serve an unquantized checkpoint "
            "on CUDA or the CPU, or sync another way (a full reload)"
        )
        platform = post_load_platform()
        if platform is not None:
            self.refused.append(
                (
                    "post_load_platform",
                    f"{type(model).__name__}: SGLang's post-load step on {platform} transforms "
                    f"the weights in ways that do not repeat; {fix}",
                )
            )
            return
        for name, module in model.named_modules():
            if hasattr(module, "kv_b_proj") and hasattr(module, "w_kc"):
                why = self._why_not(name, module, fix)
                if why is None:
                    self.layers.append((name, module))
                else:
                    self.refused.append(("mla_up_projections", why))
        if not self.layers and not self.refused:
            self.refused.append(
                (
                    "post_load_unknown",
                    f"{type(model).__name__} derives tensors after loading "
                    f"(`post_load_weights`) that weightsync does not know how to keep in step; "
                    f"{fix}",
                )
            )

    @staticmethod
    def _why_not(name: str, layer: Any, fix: str) -> str | None:
        proj = layer.kv_b_proj
        if proj is None:
            return None  # a layer that holds no kv_b_proj derives nothing
        weight = getattr(proj, "weight", None)
        method = getattr(proj, "quant_method", None)
        if (
            hasattr(proj, "qweight")
            or not isinstance(weight, torch.Tensor)
            or not weight.dtype.is_floating_point
            or weight.element_size() < 2
            or (method is not None and not type(method).__name__.startswith("Unquantized"))
        ):
            return f"MLA layer {name}: kv_b_proj is quantized; {fix}"
        if getattr(layer, "use_deep_gemm_bmm", False):
            return f"MLA layer {name}: its up-projections run DeepGEMM's block-scaled GEMMs; {fix}"
        if getattr(layer, "w_kc_qrep", None) is not None:
            return (
                f"MLA layer {name}: decode context parallelism replicates the query projection "
                f"(w_kc gathered across ranks); {fix}"
            )
        if isinstance(getattr(layer, "w_scale", None), torch.Tensor):
            return f"MLA layer {name}: its up-projections carry a quantization scale; {fix}"
        return None

    def refuse(self, accept: Mapping[str, str]) -> list[str]:
        """At connect: raise ValueError naming the first refusal unless `accept`
        (`SyncOptions.accept_unkept`) names its kind; else the accepted ones, each with its
        reason. Once accepted, the model's own post-load step no longer runs after a sync:
        what it derived at start-up stays, but for the MLA layers weightsync derives itself
        (`derive`)."""
        from weightsync.engine.refit import refuse_forms

        return refuse_forms("sglang", self.refused, accept)

    def names(self) -> list[str]:
        """The derived tensors' names (`<layer>.w_kc`, `<layer>.w_vc`)."""
        return [f"{name}.{attr}" for name, _ in self.layers for attr in DERIVED]

    @contextmanager
    def held(self) -> Iterator[None]:
        """The model's post-load step does not run inside (a sync's loads, its placement
        learning on scratch copies): the sync derives once, from what it wrote (`derive`)."""
        if not self.derives or "post_load_weights" in vars(self.model):
            yield
            return
        self.model.post_load_weights = _skip  # an instance attribute shadows the method
        try:
            yield
        finally:
            del self.model.post_load_weights

    @torch.no_grad()
    def derive(self) -> None:
        """The model's own post-load step, over every layer, from the weights it holds now
        (SGLang's `bind_or_assign` writes the derived tensors in place); where some layers
        were refused and accepted, each other MLA layer's derived tensors written from its
        weight in place instead (SGLang's step would transform the refused ones again)."""
        if self.derives and not self.refused:
            self.model.post_load_weights()
            return
        for _, layer in self.layers:  # refused layers accepted: the others derived here
            if layer.kv_b_proj is None:
                continue
            for attr, want in zip(DERIVED, self._derivation(layer)):
                getattr(layer, attr).copy_(want)

    @staticmethod
    def _derivation(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_kc, w_vc)'s values as SGLang derives them from kv_b_proj's weight (an unquantized
        one): per head, the weight's key rows and value rows, each transposed."""
        w = layer.kv_b_proj.weight
        w_kc, w_vc = w.unflatten(0, (-1, layer.qk_nope_head_dim + layer.v_head_dim)).split(
            [layer.qk_nope_head_dim, layer.v_head_dim], dim=1
        )
        return w_kc, w_vc.transpose(1, 2)

    @torch.no_grad()
    def stale(self) -> list[str]:
        """The derived tensors whose values differ from their derivation from the weights the
        model holds now (the decode would compute with other weights than the prefill)."""
        out = []
        for name, layer in self.layers:
            if layer.kv_b_proj is None:
                continue
            for attr, want in zip(DERIVED, self._derivation(layer)):
                have = getattr(layer, attr)
                if not isinstance(have, torch.Tensor) or not torch.equal(have, want):
                    out.append(f"{name}.{attr}")
        return out

    def check(self, when: str) -> None:
        """Raise naming the derived tensors that differ from their derivation."""
        stale = self.stale()
        if stale:
            raise RuntimeError(
                f"sglang: {when}: {len(stale)} derived tensor(s) differ from what SGLang derives "
                f"from the weights the engine holds ({stale[:3]}): its decode would compute "
                f"with other weights than its prefill"
            )


def post_load_platform() -> str | None:
    """The accelerator platform whose post-load forms weightsync does not derive again, or
    None (CUDA, the CPU)."""
    try:
        from sglang.srt.utils import is_hip, is_musa, is_npu
    except ImportError:
        return None
    for test, name in ((is_hip, "ROCm"), (is_npu, "Ascend"), (is_musa, "MUSA")):
        if test():
            return name
    return None
