"""nemo-automodel as the trainer's model builder, in an engine env that installs it.

A tiny Qwen2 built by `weightsync.apps.automodel.build_automodel` (nemo-automodel's model class and
its own FSDP2 parallelizer, 2 spawned ranks over gloo) yields exactly its checkpoint through
`DTensorV2Source`. nemo-automodel's Qwen3-MoE model class needs CUDA, so its part is checked
through what the source reads from such a model: the native (grouped-expert) state dict, sharded
like FSDP2 shards it, and the model's real `Qwen3MoeStateDictAdapter`; a real vLLM engine then
judges the HF names and shapes the adapter makes.
"""

from __future__ import annotations

import queue
import time

import pytest
import ray
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from weightsync.apps.models import NUM_EXPERTS, make_tiny_model
from weightsync.driver import launcher

pytest.importorskip("nemo_automodel")


def _spawn(target, *args, timeout_s: float = 240.0) -> tuple[dict, float]:
    """Run `target(rank, port, results, *args)` on 2 spawned ranks; rank 0's result and the
    seconds it all took."""
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, results, *args)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=timeout_s)
    except queue.Empty:
        out = None
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert out is not None, f"no result from rank 0; exit codes {[p.exitcode for p in procs]}"
    assert [p.exitcode for p in procs] == [0, 0]
    return out, time.perf_counter() - start


def _numpy(state: dict[str, torch.Tensor]) -> dict:
    # numpy, not torch: torch would pass shared-memory handles that die with the rank
    return {name: tensor.numpy().copy() for name, tensor in state.items()}


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def _rank_main(rank, port, results, qwen2_path, moe_path):
    """Both parts on the same 2 ranks: importing nemo-automodel costs each process ~15 s."""

    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    start = time.perf_counter()
    qwen2 = _qwen2_part(qwen2_path, moe_path)
    built = time.perf_counter()
    moe = _moe_part(moe_path)
    if rank == 0:
        results.put(
            {
                "qwen2": qwen2,
                "moe": moe,
                "qwen2_s": built - start,
                "moe_s": time.perf_counter() - built,
            }
        )
    close_trainer_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    qwen2 = make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", seed=0)
    moe = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), arch="qwen3_moe", seed=1)
    out, seconds = _spawn(_rank_main, qwen2, moe)
    print(
        f"\n2 ranks: {seconds:.1f} s in all; Qwen2 built, gathered, one step "
        f"{out['qwen2_s']:.1f} s; Qwen3-MoE grouped experts to HF {out['moe_s']:.1f} s"
    )
    for part in ("qwen2", "moe"):
        out[part]["full"] = {k: torch.from_numpy(v) for k, v in out[part]["full"].items()}
    return {"qwen2": (qwen2, out["qwen2"]), "moe": (moe, out["moe"])}


# ---- Qwen2 built by build_automodel ---------------------------------------------------------
def _qwen2_part(model_path, moe_path):
    from torch.distributed.tensor import Shard

    from weightsync.apps.automodel import build_automodel
    from weightsync.trainer.source import DTensorV2Source

    model = build_automodel(model_path, dtype="float32", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the sharded parameters
    params = dict(model.named_parameters())
    sharded = [
        name
        for name, param in params.items()
        if [type(p) for p in getattr(param, "placements", ())] == [Shard]
        and param.placements[0].dim == 0
        and param.device_mesh.size() == 2
    ]
    source = DTensorV2Source(model)
    full = dict(source.tensors())
    batch = torch.tensor([list(range(3, 35)), list(range(40, 72))])
    with torch.no_grad():  # a forward no backward follows leaves FSDP2 units unsharded
        loss = float(model(input_ids=batch, labels=batch).loss)
    unsharded = [n for n, p in model.named_parameters() if not hasattr(p, "placements")]
    after_forward = dict(source.tensors())
    resharded = all(hasattr(p, "placements") for p in model.parameters())
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    trained = dict(source.tensors())
    try:
        build_automodel(moe_path)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    return {
        "num_params": len(params),
        "sharded": sharded,
        "full": _numpy(full),
        "loss": loss,
        "refusal": refusal,
        "unsharded_by_forward": unsharded,
        "resharded": resharded,
        "same_after_forward": all(torch.equal(full[n], after_forward[n]) for n in full),
        "changed": sorted(n for n in full if not torch.equal(full[n], trained[n])),
    }


@pytest.fixture(scope="module")
def qwen2(ranks):
    return ranks["qwen2"]


def test_every_parameter_is_a_dtensor_sharded_on_dim_0_over_both_ranks(qwen2):
    _, out = qwen2
    assert len(out["sharded"]) == out["num_params"] > 0


def test_the_source_yields_the_checkpoint_exactly(qwen2):
    model_path, out = qwen2
    checkpoint = _checkpoint(model_path)
    assert sorted(out["full"]) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert out["full"][name].dtype == torch.float32
        assert torch.equal(out["full"][name], tensor), name


def test_forward_with_labels_gives_the_loss_transformers_gives(qwen2):
    from transformers import AutoModelForCausalLM

    model_path, out = qwen2
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    batch = torch.tensor([list(range(3, 35)), list(range(40, 72))])
    with torch.no_grad():
        expected = float(reference(input_ids=batch, labels=batch).loss)
    assert out["loss"] == pytest.approx(expected, rel=1e-5)


def test_after_a_forward_without_backward_the_source_reads_the_shards_again(qwen2):
    _, out = qwen2
    assert "lm_head.weight" in out["unsharded_by_forward"]  # what FSDP2 leaves behind
    assert out["resharded"]
    assert out["same_after_forward"]


def test_an_optimizer_step_changes_every_gathered_tensor(qwen2):
    _, out = qwen2
    assert out["changed"] == sorted(out["full"])


def test_an_architecture_without_a_cpu_model_class_is_refused_by_name(qwen2):
    _, out = qwen2
    assert out["refusal"] is not None
    assert "'Qwen3MoeForCausalLM'" in out["refusal"]
    assert "Qwen2ForCausalLM" in out["refusal"]


# ---- Qwen3-MoE: the adapter's HF names, judged by vLLM --------------------------------------
class _NativeModel(torch.nn.Module):
    """What `DTensorV2Source` reads from a nemo-automodel model: its state dict (here the native,
    grouped-expert one) and its `state_dict_adapter`."""

    def __init__(self, state: dict[str, torch.Tensor], adapter) -> None:
        super().__init__()
        for name, tensor in state.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        self.state_dict_adapter = adapter


def _qwen3_moe_adapter(model_path: str):
    """The adapter nemo-automodel's Qwen3MoeForCausalLM makes, with the MoE config its model
    derives from the HF config."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.state_dict_adapter import (
        Qwen3MoeStateDictAdapter,
    )
    from nemo_automodel.components.moe.config import MoEConfig
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    moe = MoEConfig(
        dim=config.hidden_size,
        inter_dim=config.intermediate_size,
        moe_inter_dim=config.moe_intermediate_size,
        n_routed_experts=config.num_experts,
        n_shared_experts=0,
        n_activated_experts=config.num_experts_per_tok,
        n_expert_groups=0,
        n_limited_groups=0,
        train_gate=True,
        gate_bias_update_factor=0.0,
        score_func="softmax",
        route_scale=1.0,
        aux_loss_coeff=0.0,
        norm_topk_prob=config.norm_topk_prob,
        expert_activation="swiglu",
        softmax_before_topk=True,
        dtype=torch.float32,
    )
    return Qwen3MoeStateDictAdapter(config, moe, BackendConfig(), dtype=torch.float32)


def _moe_part(model_path):
    import torch.distributed as dist
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from nemo_automodel.components.distributed.mesh_utils import _create_device_meshes
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.trainer.source import DTensorV2Source

    adapter = _qwen3_moe_adapter(model_path)
    native = adapter.from_hf(_checkpoint(model_path))
    mesh, _ = _create_device_meshes(FSDP2Config(), ParallelismSizes(), world_size=2)
    # FSDP2 without expert parallelism shards every parameter on dim 0: the experts' dim.
    dp_mesh = mesh["dp_shard_cp"]
    sharded = {name: distribute_tensor(t, dp_mesh, [Shard(0)]) for name, t in native.items()}
    source = DTensorV2Source(_NativeModel(sharded, adapter))
    specs = [s.to_dict() for s in source.specs()]
    full = dict(source.tensors())
    all_specs = [None, None]
    dist.all_gather_object(all_specs, specs)
    return {
        "native": {k: list(v.shape) for k, v in native.items()},
        "specs": all_specs,
        "full": _numpy(full),
    }


@pytest.fixture(scope="module")
def moe(ranks):
    return ranks["moe"]


@pytest.fixture(scope="module")
def moe_engine(moe):
    model, _ = moe
    start = time.perf_counter()
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model)
    ray.get(engine.weight_version.remote())
    print(f"vLLM engine on the tiny Qwen3-MoE started: {time.perf_counter() - start:.1f} s")
    yield engine
    ray.shutdown()


def test_the_trainer_holds_grouped_experts(moe):
    _, out = moe
    grouped = [n for n in out["native"] if n.endswith((".gate_and_up_projs", ".down_projs"))]
    assert len(grouped) == 2 * 2  # two per layer
    assert all(out["native"][n][0] == NUM_EXPERTS for n in grouped)
    assert not any(".experts.0." in n for n in out["native"])


def test_every_rank_announces_every_expert_under_its_hf_name(moe):
    model, out = moe
    checkpoint = _checkpoint(model)
    rank0, rank1 = out["specs"]
    assert rank0 == rank1
    assert {s["name"]: tuple(s["shape"]) for s in rank0} == {
        name: tuple(t.shape) for name, t in checkpoint.items()
    }
    for layer in range(2):
        for expert in range(NUM_EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight" in {
                    s["name"] for s in rank0
                }


def test_the_gathered_hf_tensors_equal_the_checkpoint(moe):
    model, out = moe
    checkpoint = _checkpoint(model)
    assert sorted(out["full"]) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(out["full"][name], tensor), name


def test_vllm_accepts_the_adapters_hf_tensors(moe, moe_engine):
    _, out = moe
    specs = out["specs"][0]
    assert ray.get(moe_engine.check_refit.remote(specs))["num_params"] == len(specs)


def test_vllm_refuses_refit_info_missing_an_expert(moe, moe_engine):
    _, out = moe
    specs = [
        s for s in out["specs"][0] if s["name"] != "model.layers.1.mlp.experts.5.down_proj.weight"
    ]
    with pytest.raises(ValueError, match=r"experts\.5\.down_proj"):
        ray.get(moe_engine.check_refit.remote(specs))


def test_vllm_refuses_an_expert_of_the_wrong_shape(moe, moe_engine):
    _, out = moe
    specs = [dict(s) for s in out["specs"][0]]
    victim = next(s for s in specs if s["name"] == "model.layers.0.mlp.experts.3.up_proj.weight")
    victim["shape"] = list(reversed(victim["shape"]))
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj.*\(256, 128\)"):
        ray.get(moe_engine.check_refit.remote(specs))
