"""Which checkpoints SGLang on CPU refuses as rotary-embedding models: each marker the preflight
check knows, alone in an otherwise plain config.json, is enough; a learned-position model is let
through."""

from __future__ import annotations

import json

import pytest

from weightsync.driver.preflight import refuse_unsupported_sglang, rope_reason

# A learned-position model (OPT's config.json, trimmed): none of the rope markers.
PLAIN = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}

# The markers the module docstring lists, spelled out here so that dropping one fails a test.
ROPE_VALUES = {
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "linear", "factor": 2.0},
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "rotary_dim": 16,
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "partial_rotary_factor": 0.5,
}
ROPE_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi",
    "phi3",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_neox",
    "gptj",
    "olmo",
    "olmo2",
    "stablelm",
    "starcoder2",
    "cohere",
    "granite",
    "internlm2",
    "minicpm",
    "exaone",
    "glm",
    "glm4",
    "chatglm",
    "baichuan",
)
MARKERS = (
    [pytest.param({key: value}, f"sets {key}", id=key) for key, value in ROPE_VALUES.items()]
    + [
        pytest.param(
            {"position_embedding_type": "rotary"},
            "position_embedding_type='rotary'",
            id="position_embedding_type",
        )
    ]
    + [
        pytest.param(
            {"model_type": model_type}, f"model_type {model_type!r}", id=f"model_type={model_type}"
        )
        for model_type in ROPE_MODEL_TYPES
    ]
)


def _checkpoint(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(("marker", "reason"), MARKERS)
def test_a_rope_model_is_recognised_by_each_marker_alone(marker, reason):
    assert rope_reason(PLAIN) is None
    assert reason in (rope_reason({**PLAIN, **marker}) or "not recognised")


@pytest.mark.parametrize(("marker", "reason"), MARKERS)
def test_a_rope_marker_inside_text_config_is_recognised(marker, reason):
    config = {"architectures": ["SomeVisionWrapper"], "text_config": {**PLAIN, **marker}}
    assert reason in (rope_reason(config) or "not recognised")


@pytest.mark.parametrize(("marker", "reason"), MARKERS)
def test_sglang_on_cpu_refuses_a_checkpoint_with_each_rope_marker(tmp_path, marker, reason):
    path = _checkpoint(tmp_path, {**PLAIN, **marker})
    with pytest.raises(ValueError, match="rotary position embeddings") as info:
        refuse_unsupported_sglang(path, cuda=False)
    assert reason in str(info.value)
    assert path in str(info.value)


@pytest.mark.parametrize(
    "config",
    [
        PLAIN,
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4},
        {**PLAIN, "rope_theta": None, "rope_scaling": None},
        {**PLAIN, "position_embedding_type": "absolute"},
    ],
    ids=["opt", "gpt2", "rope-keys-set-to-null", "absolute-positions"],
)
def test_a_model_with_learned_positions_passes(tmp_path, config):
    assert rope_reason(config) is None
    refuse_unsupported_sglang(_checkpoint(tmp_path, config), cuda=False)


def test_a_rope_model_passes_when_sglang_has_cuda(tmp_path):
    path = _checkpoint(tmp_path, {**PLAIN, "model_type": "qwen2", "rope_theta": 1e6})
    refuse_unsupported_sglang(path, cuda=True)
    with pytest.raises(ValueError, match="rotary"):
        refuse_unsupported_sglang(path, engine_args={"device": "cpu"}, cuda=True)
