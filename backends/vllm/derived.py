"""Tensors vLLM derives from loaded weights after loading, kept in step with syncs (runs inside
vLLM's workers).

vLLM's MLA attention (DeepSeek-V2/V3, Kimi-K2 and the like) decodes with two tensors it derives
from `kv_b_proj.weight` once, in `process_weights_after_loading`: `W_UK_T` and `W_UV`, the
weight's key and value halves per head, transposed (parameters of the layer: vLLM's
`split_kv_b_proj`, then `replace_parameter`). No checkpoint or trainer tensor lands in them.
Where they are views of the weight's own storage (an unquantized float32 weight on a CPU), an
in-place write of the weight reaches them; anything that moves the weight's memory (the
one-copy path's sharing) or a derivation that copies (bfloat16, every GPU deployment) leaves
them on the old values, and decode then runs on the startup weights while prefill runs on the
new ones. `DerivedTensors` derives them again from the weight as the model holds it
(`derive`, before an updated engine serves), says which differ from their derivation
(`stale`, a verified sync fails on any), and at connect refuses the MLA forms it cannot
derive again, naming the layer (`refused`): kv_b_proj's weight dropped for a packed AMX
kernel, a quantized kv_b_proj, ROCm's quantized batched GEMMs, query replication across
decode context parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

DERIVED = ("W_UK_T", "W_UV")  # the layer's attributes, in that order
REFUSED_KIND = "mla_up_projections"  # `SyncOptions.accept_unkept`'s kind for a refused layer


class DerivedTensors:
    """The MLA layers of one vLLM model (none for other models)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        """`model`: the worker's model; None for none."""
        self.layers: list[tuple[str, Any]] = []  # (module name, MLA attention layer)
        # (kind, why) a layer cannot be kept in step, one per layer (`refuse`); such a layer's
        # derived tensors are neither derived again nor checked
        self.refused: list[tuple[str, str]] = []
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._names: dict[tuple[int, str], str] = {}
        for name, module in model.named_modules() if model is not None else ():
            if not _is_mla(module):
                continue
            why = self._why_not(name, module)
            if why is not None:
                self.refused.append((REFUSED_KIND, why))
                continue
            self.layers.append((name, module))
            for attr in DERIVED:
                self._names[(id(module), attr)] = names.get(
                    id(getattr(module, attr)), f"{name}.{attr}"
                )

    @staticmethod
    def _why_not(name: str, layer: Any) -> str | None:
        fix = (
            "weightsync cannot derive them again after a sync; on a CPU start the engine "
            "with attention_backend='CPU_MLA' and an unquantized checkpoint"
        )
        if getattr(layer, "is_amx_bmm_enabled", False):
            return (
                f"MLA layer {name}: vLLM's AMX MLA kernel packs its up-projections from "
                f"kv_b_proj and drops kv_b_proj's weight; {fix}"
            )
        if getattr(layer, "is_aiter_triton_fp8_bmm_enabled", False) or getattr(
            layer, "is_aiter_triton_fp4_bmm_enabled", False
        ):
            return f"MLA layer {name}: its up-projections are quantized (ROCm aiter); {fix}"
        if getattr(layer, "dcp_q_replicate", False):
            return (
                f"MLA layer {name}: decode context parallelism with query replication "
                f"gathers W_UK_T across ranks; {fix}"
            )
        method = getattr(layer.kv_b_proj, "quant_method", None)
        if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
            return f"MLA layer {name}: kv_b_proj is quantized ({type(method).__name__}); {fix}"
        weight = getattr(layer.kv_b_proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            return f"MLA layer {name}: kv_b_proj holds no weight; {fix}"
        if any(not isinstance(getattr(layer, a, None), torch.Tensor) for a in DERIVED):
            return f"MLA layer {name}: no {' / '.join(DERIVED)} tensors to keep in step; {fix}"
        return None

    def refuse(self, accept: Mapping[str, str]) -> list[str]:
        """At connect: raise ValueError naming the first refused layer unless `accept`
        (`SyncOptions.accept_unkept`) names its kind; else the accepted layers, each with
        its reason. An accepted layer decodes with the up-projections it derived at start-up,
        whatever the syncs write."""
        from weightsync.engine.refit import refuse_forms

        return refuse_forms("vllm", self.refused, accept)

    def names(self) -> list[str]:
        """The derived tensors' parameter names."""
        return [self._names[(id(layer), attr)] for _, layer in self.layers for attr in DERIVED]

    @staticmethod
    def _derivation(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK_T, W_UV) as vLLM derives them from the layer's kv_b_proj weight now."""
        from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

        w_uk, w_uv = split_kv_b_proj(
            layer.kv_b_proj,
            layer.W_UV.dtype,
            layer.kv_lora_rank,
            layer.num_heads,
            layer.qk_nope_head_dim,
            layer.v_head_dim,
        )
        return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)

    @staticmethod
    def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(
            a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset()
            and tuple(a.shape) == tuple(b.shape)
            and a.stride() == b.stride()
            and a.dtype == b.dtype
        )

    def views(self) -> list[str]:
        """The derived tensors that are views of their weight's own memory (what writes the
        weight in place writes them)."""
        out = []
        for _, layer in self.layers:
            for attr, want in zip(DERIVED, self._derivation(layer)):
                if self._same_view(getattr(layer, attr).data, want):
                    out.append(self._names[(id(layer), attr)])
        return out

    @torch.no_grad()
    def derive(self, only: set[str] | None = None) -> list[str]:
        """Write each derived tensor (of `only`'s names, when given) from its weight as the
        model holds it now, in place (their memory does not move); a view of the weight is
        left as it is. The names written."""
        written = []
        for _, layer in self.layers:
            for attr, want in zip(DERIVED, self._derivation(layer)):
                name = self._names[(id(layer), attr)]
                have = getattr(layer, attr).data
                if (only is not None and name not in only) or self._same_view(have, want):
                    continue
                have.copy_(want.clone() if _overlap(have, want) else want)
                written.append(name)
        return written

    @torch.no_grad()
    def stale(self) -> list[str]:
        """The derived tensors whose values differ from their derivation from the weight as
        the model holds it now (a forward would decode with other weights than it prefills
        with)."""
        out = []
        for _, layer in self.layers:
            for attr, want in zip(DERIVED, self._derivation(layer)):
                have = getattr(layer, attr).data
                if not self._same_view(have, want) and not torch.equal(have, want):
                    out.append(self._names[(id(layer), attr)])
        return out

    def check(self, when: str) -> None:
        """Raise naming the derived tensors that differ from their derivation."""
        stale = self.stale()
        if stale:
            raise RuntimeError(
                f"vllm: {when}: {len(stale)} derived tensor(s) differ from what vLLM derives "
                f"from the weights the engine holds ({stale[:3]}): its decode would compute "
                f"with other weights than its prefill"
            )


def _is_mla(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return isinstance(module, MLAAttention)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
