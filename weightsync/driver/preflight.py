"""Engine, model and machine combinations known not to run, refused before an engine starts
(SGLang: rope models and TP > 1 on CPU; vLLM: a tensor-parallel size the model cannot be split by).

Without this, SGLang 0.5 on a machine without CUDA took a Qwen2 checkpoint, spent ~58 s starting
its scheduler, which then failed importing `vllm._custom_ops` (its non-CUDA rotary embedding is
vLLM's kernel, and the sglang env has no vLLM by design) and killed the whole actor; the caller
saw only Ray's "The actor never ran". Plain Python, no torch and no engine import: the launcher
runs these checks in the driver before it creates the actor, and the engine actor runs them
again in its own process (which knows for sure whether it has CUDA).

How a checkpoint is judged to use rotary position embeddings (`rope_reason`), from its
config.json (and its `text_config`, for multimodal wrappers): any of the keys rope_theta,
rope_scaling, rope_parameters, rotary_dim, rotary_pct, rotary_emb_base, partial_rotary_factor
with a value, `position_embedding_type == "rotary"`, or a model_type in `ROPE_MODEL_TYPES`.
OPT and GPT-2 (learned positions) have none of these.
"""

from __future__ import annotations

import json
import os
from typing import Any

ROPE_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rotary_dim",
    "rotary_pct",
    "rotary_emb_base",
    "partial_rotary_factor",
)
ROPE_MODEL_TYPES = frozenset(
    {
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
    }
)


def read_config(model_path: str) -> dict[str, Any] | None:
    """The checkpoint's config.json as a dict; None when `model_path` is not a local folder
    (a hub id, or a folder on another node). A local-looking path that does not exist raises
    FileNotFoundError."""
    if os.path.isdir(model_path):
        config_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"checkpoint {model_path!r} has no config.json")
        with open(config_path) as f:
            return json.load(f)
    if os.path.isabs(model_path) or model_path.startswith((".", "~")):
        raise FileNotFoundError(f"no checkpoint folder at {model_path!r}")
    return None


def rope_reason(config: dict[str, Any]) -> str | None:
    """Why `config` (a config.json) is a rotary-embedding model, e.g. "rope_parameters is set";
    None when nothing says so."""
    for part in (config, config.get("text_config") or {}):
        for key in ROPE_KEYS:
            if part.get(key) is not None:
                return f"config.json sets {key}"
        if part.get("position_embedding_type") == "rotary":
            return "config.json has position_embedding_type='rotary'"
        if part.get("model_type") in ROPE_MODEL_TYPES:
            return f"model_type {part['model_type']!r} uses rotary position embeddings"
    return None


def sglang_runs_on_cpu(engine_args: dict[str, Any], *, cuda: bool) -> bool:
    device = engine_args.get("device")
    return device == "cpu" if device is not None else not cuda


def refuse_unsupported_sglang(
    model_path: str, *, engine_args: dict[str, Any] | None = None, cuda: bool
) -> None:
    """Raise ValueError for an SGLang engine that is known not to start: on CPU (`cuda` False
    and no device in `engine_args`, or device="cpu"), a rotary-embedding model or tp_size > 1.
    Called by `SglEngineActor.__init__` and, before the actor exists, by the launcher."""
    engine_args = engine_args or {}
    if not sglang_runs_on_cpu(engine_args, cuda=cuda):
        return
    tp_size = int(engine_args.get("tp_size") or 1)
    if tp_size > 1:
        raise ValueError(
            f"sglang on CPU cannot run tp_size={tp_size} (model {model_path!r}): SGLang 0.5's "
            f"tensor-parallel group needs a CUDA device even with device='cpu' (NCCL: \"Expected "
            f'a cuda device, but got: cpu"). Use tp_size=1, or vLLM for tensor parallelism on '
            f"CPU (weightsync.backends.vllm.engine.VllmEngineActor, tensor_parallel_size), or run SGLang "
            f"on a CUDA GPU"
        )
    config = read_config(model_path)
    if config is None:
        return
    why = rope_reason(config)
    if why is not None:
        arch = ", ".join(config.get("architectures") or []) or config.get("model_type", "?")
        raise ValueError(
            f"sglang on CPU cannot run {model_path!r} ({arch}): it uses rotary position "
            f"embeddings ({why}), and SGLang 0.5 without CUDA computes rotary embeddings with "
            f"vLLM's kernel (vllm._custom_ops), which the sglang env does not have; its own CPU "
            f"kernels (SGLANG_USE_CPU_ENGINE=1) need a CPU build of sgl-kernel, which is not on "
            f"the package index. Serve this model with vLLM on CPU "
            f"(weightsync.backends.vllm.engine.VllmEngineActor), or run SGLang on a CUDA GPU"
        )


def cuda_device_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to processes (device files, CUDA_VISIBLE_DEVICES),
    without importing torch. False means an engine here surely runs without CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))


def sglang_launch_check(args: tuple, kwargs: dict[str, Any]) -> None:
    """The launcher's check for an `SglEngineActor(model_path, ...)` started on this node."""
    model_path = args[0] if args else kwargs.get("model_path")
    # A path that is not a local folder is left to the actor, which names what is missing.
    if isinstance(model_path, str) and os.path.isdir(model_path):
        refuse_unsupported_sglang(
            model_path, engine_args=kwargs.get("engine_args"), cuda=cuda_device_present()
        )


def tp_divisibility_errors(config: dict[str, Any], tp_size: int) -> list[str]:
    """What in `config` (a config.json) a tensor-parallel size of `tp_size` does not divide:
    attention heads, and the MLP / expert widths that column-parallel layers split; KV heads
    either divide among the workers or are replicated (the TP size a multiple of them)."""
    errors = []
    part = config.get("text_config") or config
    heads = part.get("num_attention_heads")
    if heads and heads % tp_size:
        errors.append(f"num_attention_heads={heads}")
    kv = part.get("num_key_value_heads")
    if kv and kv % tp_size and tp_size % kv:
        errors.append(f"num_key_value_heads={kv} (neither divides the other)")
    for key in ("intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner"):
        width = part.get(key)
        if isinstance(width, int) and width % tp_size:
            errors.append(f"{key}={width}")
    return errors


def refuse_unsupported_vllm(
    model_path: str, *, tensor_parallel_size: int = 1, engine_args: dict[str, Any] | None = None
) -> None:
    """Raise ValueError for a vLLM engine known not to start: a tensor-parallel size that is
    not a positive int, or one the model's heads or MLP width cannot be split by (vLLM itself
    would fail after a minute of start-up, inside a worker process)."""
    tp_size = tensor_parallel_size
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size!r}: must be a positive int")
    if "tensor_parallel_size" in (engine_args or {}):
        raise ValueError(
            "engine_args['tensor_parallel_size']: pass tensor_parallel_size= to "
            "the engine actor instead (it also binds the workers' CPU threads)"
        )
    config = read_config(model_path)
    if config is None or tp_size == 1:
        return
    errors = tp_divisibility_errors(config, tp_size)
    if errors:
        raise ValueError(
            f"vllm: tensor_parallel_size={tp_size} does not divide model {model_path!r}: "
            f"{', '.join(errors)}; use a tensor_parallel_size that divides each"
        )


def cpu_binding(num_workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `num_workers` CPU workers: this process's cores split
    into that many consecutive groups ("0|1", "0-3|4-7"). Fewer cores than workers raise."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_workers:
        raise ValueError(
            f"tensor_parallel_size={num_workers} on CPU needs a core per worker; "
            f"this process may use {len(cores)} ({cores})"
        )
    per = len(cores) // num_workers
    groups = [cores[i * per : (i + 1) * per] for i in range(num_workers)]

    def spell(group: list[int]) -> str:
        if len(group) == 1:
            return str(group[0])
        if group[-1] - group[0] == len(group) - 1:
            return f"{group[0]}-{group[-1]}"
        return ",".join(map(str, group))

    return "|".join(spell(g) for g in groups)


def vllm_launch_check(args: tuple, kwargs: dict[str, Any]) -> None:
    """The launcher's check for a `VllmEngineActor(model_path, ...)`."""
    model_path = args[0] if args else kwargs.get("model_path")
    if isinstance(model_path, str) and os.path.isdir(model_path):
        refuse_unsupported_vllm(
            model_path,
            tensor_parallel_size=kwargs.get("tensor_parallel_size", 1),
            engine_args=kwargs.get("engine_args"),
        )
