"""The trainer's model built by nemo-automodel: its model classes and its own FSDP2 parallelizer.

NeMo-RL's DTensor policy worker v2 builds its model this way, so a weightsync trainer built here
has the same parameter layout (FSDP2 DTensors) and the same names (HF names, or the model's
`state_dict_adapter.to_hf` where it has one, which `DTensorV2Source` applies).

On CUDA, `NeMoAutoModelForCausalLM.from_pretrained` does everything. On a CPU it cannot: in
nemo-automodel 0.7.0 it calls `torch.cuda.current_device()` unconditionally, and so does the
Qwen3-MoE model class (its rope cache). What does run on a CPU over gloo is the model class of
`nemo_automodel.components.models.<arch>.model`, loaded here from the checkpoint's safetensors,
and then sharded by nemo-automodel's `parallelize_model` on the meshes it makes itself.

nemo_automodel is imported inside the functions: it is installed only in engine envs built with
their `trainer` group (`weightsync env build NAME --with trainer`), and importing it takes
seconds.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import sys
from typing import TYPE_CHECKING

import torch

from weightsync.trainer.source import tied_aliases
from weightsync.wire.specs import dtype_from_str

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

# Architectures whose nemo-automodel model class builds and trains on a CPU (checked on 0.7.0).
CPU_MODEL_MODULES: dict[str, str] = {
    "Qwen2ForCausalLM": "nemo_automodel.components.models.qwen2.model",
}


def build_automodel(model_path: str, *, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """The causal LM of the HF checkpoint at `model_path`, built and FSDP2-sharded by
    nemo-automodel over all ranks of the current process group.

    Collective: every rank of an initialised torch.distributed group (gloo on CPU, NCCL on
    GPU; `weightsync.trainer.process_group.init_trainer_group`) calls it with the same arguments. Parameters
    are stored in `dtype` and computed in `dtype` (FSDP2 mixed precision: same param dtype,
    float32 gradient reduction); they come back as DTensors sharded on dim 0, in eval mode.
    `model(input_ids=..., labels=...)` returns a transformers `CausalLMOutputWithPast` whose
    `loss` is the mean next-token cross-entropy (labels shifted inside, -100 ignored).
    """
    import torch.distributed as dist

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    if importlib.util.find_spec("nemo_automodel") is None:
        raise ModuleNotFoundError(
            f"model_builder='nemo_automodel' needs nemo-automodel, which {sys.executable} lacks: "
            f"build the engine env with its trainer group (weightsync env build NAME --with "
            f"trainer), or use model_builder='transformers'"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "build_automodel is collective: initialise the trainer's process "
            "group first (weightsync.trainer.process_group.init_trainer_group)"
        )
    torch_dtype = dtype_from_str(dtype)
    if device == "cuda":
        return _build_on_cuda(model_path, torch_dtype)
    return _build_on_cpu(model_path, torch_dtype)


def _fsdp2_config(torch_dtype: torch.dtype):
    from nemo_automodel.components.distributed.config import FSDP2Config
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # nemo-automodel's default computes in bfloat16; here the trainer computes in the dtype it
    # stores, so a float32 trainer matches a float32 reference and engine.
    return FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch_dtype, reduce_dtype=torch.float32)
    )


def _build_on_cuda(model_path: str, torch_dtype: torch.dtype) -> nn.Module:
    import torch.distributed as dist
    from nemo_automodel import NeMoAutoModelForCausalLM
    from nemo_automodel.components.distributed.config import DistributedSetup

    setup = DistributedSetup.build(_fsdp2_config(torch_dtype), world_size=dist.get_world_size())
    model = NeMoAutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch_dtype, distributed_setup=setup
    )
    return model.eval()


def _build_on_cpu(model_path: str, torch_dtype: torch.dtype) -> nn.Module:
    import importlib

    import torch.distributed as dist
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.mesh_utils import _create_device_meshes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.models.common import BackendConfig
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    arch = (config.architectures or [config.model_type])[0]
    module = CPU_MODEL_MODULES.get(arch)
    if module is None:
        raise ValueError(
            f"{model_path}: architecture {arch!r} has no nemo-automodel model class that builds "
            f"on a CPU here; supported on CPU: {sorted(CPU_MODEL_MODULES)} (on CUDA, any "
            f"architecture NeMoAutoModelForCausalLM supports)"
        )
    # The default RMSNorm upcasts to float32 in a torch.compile'd kernel: ~30 s of inductor per
    # process on a CPU. A float32 model gets the same math from the plain one.
    backend = BackendConfig(rms_norm="torch" if torch_dtype == torch.float32 else "torch_fp32")
    model = getattr(importlib.import_module(module), arch)(config, backend=backend)
    # FSDP2 needs one dtype for all parameters (the class may leave norms in float32).
    model.to(dtype=torch_dtype)
    load_safetensors(model, model_path)
    strategy = _fsdp2_config(torch_dtype)
    mesh, _ = _create_device_meshes(strategy, ParallelismSizes(), world_size=dist.get_world_size())
    model = parallelize_model(model, MeshContext.from_meshes(mesh, None, strategy_config=strategy))
    logger.info(
        "rank %d: built %s from %s with nemo-automodel (FSDP2 over %d ranks, %s)",
        dist.get_rank(),
        arch,
        model_path,
        dist.get_world_size(),
        torch_dtype,
    )
    return model.eval()


def load_safetensors(model: nn.Module, model_path: str) -> None:
    """Copy every tensor of the `*.safetensors` files at `model_path` into the (unsharded)
    `model`, whose state dict must use the checkpoint's names: every checkpoint tensor must
    find its parameter, with its shape, and every parameter must get one (a tied alias such
    as `lm_head.weight` may be absent)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"{model_path}: no *.safetensors files; save the checkpoint with "
            f"safe_serialization=True"
        )
    state = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    target = state.get(name)
                    if target is None:
                        raise ValueError(
                            f"{path}: tensor {name!r} has no parameter in {type(model).__name__}"
                        )
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"{path}: tensor {name!r}: checkpoint shape {tuple(tensor.shape)} != "
                            f"model shape {tuple(target.shape)}; config.json and the weights "
                            f"disagree"
                        )
                    target.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(state) - loaded - set(tied_aliases(model)))
    if missing:
        raise ValueError(
            f"{model_path}: the checkpoint lacks {len(missing)} tensor(s) of "
            f"{type(model).__name__}, e.g. {missing[:5]}"
        )
