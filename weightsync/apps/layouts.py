"""Checkpoint layouts for benchmarks: the names and shapes of real models' tensors, no values.

Per-tensor costs decide a sync's rate on real checkpoints (many small norms and biases, thousands
of per-expert matrices), so benchmarks run these layouts as well as uniform large tensors:
- "llama8b": Llama-3-8B (32 layers, GQA 32/8 heads, untied head): 291 tensors, 16.1 GB in bf16.
- "qwen3-30b-a3b": Qwen3-30B-A3B (48 layers, 128 experts of 768, q/k norms): 18867 tensors,
  61.1 GB in bf16; `num_layers` cuts it (24 layers: 9435 tensors).
- "mla-moe": a Kimi-K2-shaped MLA MoE (61 layers, the first dense, 384 experts of 2048 and one
  shared expert per MoE layer, MLA attention with q/kv low-rank projections and their norms):
  69975 tensors, 2.05 TB in bf16; `num_experts` sets the experts per layer (1152: 208215 tensors,
  the tensor counts of the largest checkpoints), `num_layers` cuts it. At shrink 8 (widths / 8)
  the 384-expert layout is ~32 GB.
- "deepseek-v3": DeepSeek-V3 (the same MLA MoE with 128 heads, 256 experts, 3 dense layers):
  671.0B parameters without its multi-token-prediction layer, 45,395 tensors.
- "llama70b": Llama-3-70B (80 layers, GQA 64/8 heads): 70.6B parameters, 723 tensors.
- "uniform": `num_tensors` square-ish tensors of `tensor_bytes` each.
`shrink` divides every width of a real layout (hidden size, head counts, intermediate sizes,
vocabulary) and keeps its tensor count, so a host with little memory runs the same many-tensor
layout at about 1/shrink**2 of its bytes (CPU benchmarks: scripts/cpu_layout_bench.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

Layout = list[tuple[str, tuple[int, ...]]]

LAYOUTS = ("uniform", "llama8b", "qwen3-30b-a3b", "mla-moe", "deepseek-v3", "llama70b")


def _dense_layer(
    i: int, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> Layout:
    p = f"model.layers.{i}"
    return [
        (f"{p}.input_layernorm.weight", (hidden,)),
        (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
        (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
        (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
        (f"{p}.post_attention_layernorm.weight", (hidden,)),
        (f"{p}.mlp.gate_proj.weight", (intermediate, hidden)),
        (f"{p}.mlp.up_proj.weight", (intermediate, hidden)),
        (f"{p}.mlp.down_proj.weight", (hidden, intermediate)),
    ]


def _shrunk(shrink: int, *widths: int) -> list[int]:
    if not isinstance(shrink, int) or shrink < 1:
        raise ValueError(f"shrink={shrink!r}: must be an int >= 1 (1 keeps the real widths)")
    return [max(1, w // shrink) for w in widths]


def _llama(num_layers: int, shrink: int, *widths: int) -> Layout:
    """A Llama-3 layout of these (hidden, vocab, heads, kv heads, intermediate) widths."""
    hidden, vocab, heads, kv_heads, intermediate = _shrunk(shrink, *widths)
    out: Layout = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(num_layers):
        out += _dense_layer(
            i,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=128,
            intermediate=intermediate,
        )
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def llama8b(num_layers: int = 32, *, shrink: int = 1) -> Layout:
    return _llama(num_layers, shrink, 4096, 128256, 32, 8, 14336)


def qwen3_30b_a3b(num_layers: int = 48, *, shrink: int = 1) -> Layout:
    hidden, vocab, heads, kv_heads, moe_intermediate = _shrunk(shrink, 2048, 151936, 32, 4, 768)
    head_dim, experts = 128, 128
    out: Layout = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (f"{p}.self_attn.q_norm.weight", (head_dim,)),
            (f"{p}.self_attn.k_norm.weight", (head_dim,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate.weight", (experts, hidden)),
        ]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            out += [
                (f"{q}.gate_proj.weight", (moe_intermediate, hidden)),
                (f"{q}.up_proj.weight", (moe_intermediate, hidden)),
                (f"{q}.down_proj.weight", (hidden, moe_intermediate)),
            ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def mla_moe(
    num_layers: int = 61,
    *,
    num_experts: int = 384,
    dense_layers: int = 1,
    shrink: int = 1,
    num_heads: int = 64,
    vocab_size: int = 163840,
) -> Layout:
    hidden, vocab, heads, moe_inter, dense_inter, q_rank, kv_rank = _shrunk(
        shrink, 7168, vocab_size, num_heads, 2048, 18432, 1536, 512
    )
    nope, rope, v_dim = _shrunk(shrink, 128, 64, 128)
    out: Layout = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_a_proj.weight", (q_rank, hidden)),
            (f"{p}.self_attn.q_a_layernorm.weight", (q_rank,)),
            (f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank)),
            (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden)),
            (f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,)),
            (f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_rank)),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * v_dim)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
        ]
        if i < dense_layers:
            out += [
                (f"{p}.mlp.gate_proj.weight", (dense_inter, hidden)),
                (f"{p}.mlp.up_proj.weight", (dense_inter, hidden)),
                (f"{p}.mlp.down_proj.weight", (hidden, dense_inter)),
            ]
            continue
        out += [
            (f"{p}.mlp.gate.weight", (num_experts, hidden)),
            (f"{p}.mlp.gate.e_score_correction_bias", (num_experts,)),
            (f"{p}.mlp.shared_experts.gate_proj.weight", (moe_inter, hidden)),
            (f"{p}.mlp.shared_experts.up_proj.weight", (moe_inter, hidden)),
            (f"{p}.mlp.shared_experts.down_proj.weight", (hidden, moe_inter)),
        ]
        for e in range(num_experts):
            q = f"{p}.mlp.experts.{e}"
            out += [
                (f"{q}.gate_proj.weight", (moe_inter, hidden)),
                (f"{q}.up_proj.weight", (moe_inter, hidden)),
                (f"{q}.down_proj.weight", (hidden, moe_inter)),
            ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


# How an engine fuses a checkpoint's tensors into its parameters (vLLM's layout for these
# models): (name suffix pattern, fused parameter suffix, whether each member is one expert's).
_FUSED = (
    (re.compile(r"(.*\.self_attn)\.[qkv]_proj\.weight$"), "qkv_proj.weight", False),
    (re.compile(r"(.*\.mlp)\.(?:gate|up)_proj\.weight$"), "gate_up_proj.weight", False),
    (re.compile(r"(.*\.mlp\.experts)\.\d+\.(?:gate|up)_proj\.weight$"), "w13_weight", True),
    (re.compile(r"(.*\.mlp\.experts)\.\d+\.down_proj\.weight$"), "w2_weight", True),
)


def fused(shapes: Layout) -> tuple[Layout, dict[str, tuple[str, int]]]:
    """The parameters an engine serving `shapes` holds (vLLM's: q/k/v in one `qkv_proj`,
    gate/up in one `gate_up_proj`, every expert's gate and up in one `w13_weight` of shape
    [experts, 2 * intermediate, hidden] and their down in one `w2_weight`; other tensors as
    they are), and where each checkpoint tensor lands: {tensor: (parameter, first element)},
    its elements back to back from there."""
    members: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    experts: dict[str, bool] = {}
    order: list[str] = []
    for name, shape in shapes:
        pname = name
        for pattern, suffix, per_expert in _FUSED:
            match = pattern.match(name)
            if match:
                pname = f"{match.group(1)}.{suffix}"
                experts[pname] = per_expert
                break
        if pname not in members:
            members[pname] = []
            order.append(pname)
        members[pname].append((name, shape))
    params: Layout = []
    where: dict[str, tuple[str, int]] = {}
    for pname in order:
        group = members[pname]
        start = 0
        for name, shape in group:
            where[name] = (pname, start)
            start += math.prod(shape)
        if pname not in experts:
            params.append((pname, group[0][1]))
            continue
        rows, cols = sum(s[0] for _, s in group), group[0][1][1]
        if experts[pname]:  # [experts, rows of one expert, cols]
            count = len({n.split(".experts.")[1].split(".")[0] for n, _ in group})
            params.append((pname, (count, rows // count, cols)))
        else:
            params.append((pname, (rows, cols)))
    return params, where


def deepseek_v3(num_layers: int = 61, *, shrink: int = 1) -> Layout:
    """DeepSeek-V3 (671B; its multi-token-prediction layer left out): the MLA MoE with 128
    heads, 256 experts, the first 3 layers dense, a 129280-token vocabulary."""
    return mla_moe(
        num_layers,
        num_experts=256,
        dense_layers=3,
        shrink=shrink,
        num_heads=128,
        vocab_size=129280,
    )


def llama70b(num_layers: int = 80, *, shrink: int = 1) -> Layout:
    return _llama(num_layers, shrink, 8192, 128256, 64, 8, 28672)


def uniform(num_tensors: int, tensor_bytes: int, element_bytes: int = 2) -> Layout:
    numel = max(1, tensor_bytes // element_bytes)
    cols = 1 << max(0, (numel.bit_length() - 1) // 2)
    return [(f"layers.{i}.weight", (math.ceil(numel / cols), cols)) for i in range(num_tensors)]


def layout(
    name: str,
    *,
    num_layers: int | None = None,
    num_tensors: int = 64,
    tensor_bytes: int = 256 << 20,
    shrink: int = 1,
    num_experts: int | None = None,
) -> Layout:
    """The layout called `name` (one of LAYOUTS); `shrink` divides a real layout's widths;
    `num_experts`: experts per MoE layer of "mla-moe" (default 384)."""
    if name == "llama8b":
        return llama8b(32 if num_layers is None else num_layers, shrink=shrink)
    if name == "qwen3-30b-a3b":
        return qwen3_30b_a3b(48 if num_layers is None else num_layers, shrink=shrink)
    if name == "mla-moe":
        return mla_moe(
            61 if num_layers is None else num_layers,
            num_experts=384 if num_experts is None else num_experts,
            shrink=shrink,
        )
    if name == "deepseek-v3":
        return deepseek_v3(61 if num_layers is None else num_layers, shrink=shrink)
    if name == "llama70b":
        return llama70b(80 if num_layers is None else num_layers, shrink=shrink)
    if name == "uniform":
        return uniform(num_tensors, tensor_bytes)
    raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")


def nbytes(shapes: Layout, element_bytes: int = 2) -> int:
    return sum(math.prod(shape) for _, shape in shapes) * element_bytes


def build_module(shapes: Layout, *, device: str = "cpu", fill: bool = False, seed: int = 0) -> Any:
    """An `nn.Module` whose parameters have exactly these names and shapes (bf16, no grad):
    zeros, or with `fill` random normal values from `seed`."""
    import torch

    root = torch.nn.Module()
    generator = torch.Generator(device=device).manual_seed(seed) if fill else None
    for name, shape in shapes:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        tensor = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        if fill:
            tensor.normal_(generator=generator)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root
