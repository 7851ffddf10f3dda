"""A tiny Qwen3-MoE (transformers' grouped experts: 3-D parameters) under a real 2-process gloo
FSDP2 group: it shards, trains, and its tensors leave as the checkpoint holds them."""

from __future__ import annotations

import queue

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from weightsync.apps.models import NUM_EXPERTS, build_model
from weightsync.trainer.process_group import (
    close_trainer_group,
    init_trainer_group,
    shard_model,
    transformer_blocks,
)
from weightsync.trainer.source import DTensorV2Source, ShardPieces


def _numpy(tensor: torch.Tensor):
    # numpy, not torch: torch would pass shared-memory handles that die with the rank
    return tensor.reshape(-1).view(torch.uint8).numpy().copy()


def _rank_main(rank, port, results):
    init_trainer_group(
        rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    model = shard_model(build_model("qwen3_moe", "tiny", seed=3), device="cpu")
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    source = DTensorV2Source(model)
    specs = [s.to_dict() for s in source.specs()]
    full = {name: _numpy(t) for name, t in source.tensors()}
    pieces = [
        (name, None if data is None else _numpy(data), offset)
        for name, data, offset in ShardPieces(source, rank=rank)
    ]
    batch = torch.arange(3, 51).view(2, 24)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    results.put(
        (
            rank,
            {
                "specs": specs,
                "full": full,
                "pieces": pieces,
                "expert_placements": [
                    (type(p).__name__, getattr(p, "dim", None)) for p in experts.placements
                ],
                "local_experts": experts.to_local().shape[0],
                "grad_finite": all(
                    bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters()
                ),
            },
        )
    )
    close_trainer_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        by_rank = dict(results.get(timeout=240) for _ in range(2))
    except queue.Empty:
        by_rank = {}
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return by_rank


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes for the same model, unsharded."""
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("qwen3_moe")
    build_model("qwen3_moe", "tiny", seed=3).save_pretrained(path)
    return load_file(f"{path}/model.safetensors")


def test_only_the_outermost_blocks_are_sharded_units():
    model = build_model("qwen3_moe", "tiny")
    assert [type(b).__name__ for b in transformer_blocks(model)] == ["Qwen3MoeDecoderLayer"] * 2


def test_fsdp2_shards_grouped_experts_on_the_expert_dim_and_trains(ranks):
    out = ranks
    for rank in (0, 1):
        assert out[rank]["expert_placements"] == [("Shard", 0)]
        assert out[rank]["local_experts"] == NUM_EXPERTS // 2
        assert out[rank]["grad_finite"]


def test_tensors_are_the_checkpoints_per_expert_names_and_values(ranks, checkpoint):
    out = ranks[0]
    assert set(out["full"]) == set(checkpoint)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in out["full"]
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in out["full"])
    for name, want in checkpoint.items():
        assert bytes(out["full"][name]) == bytes(_numpy(want)), name
    assert {s["name"]: tuple(s["shape"]) for s in out["specs"]} == {
        n: tuple(t.shape) for n, t in checkpoint.items()
    }


def test_each_rank_writes_the_experts_it_holds_and_the_pieces_rebuild_the_checkpoint(
    ranks, checkpoint
):
    by_rank = ranks
    names = [n for n, _, _ in by_rank[0]["pieces"]]
    assert (
        names == [n for n, _, _ in by_rank[1]["pieces"]] == [s["name"] for s in by_rank[0]["specs"]]
    )
    for i, name in enumerate(names):
        want = _numpy(checkpoint[name])
        buf = bytearray(len(want))
        written = 0
        for rank in (0, 1):
            _, data, offset = by_rank[rank]["pieces"][i]
            if data is not None:
                buf[offset : offset + data.size] = data.tobytes()
                written += data.size
        assert written == len(want), name  # each byte written exactly once
        assert bytes(buf) == bytes(want), name
    # No gather for the experts: experts 0-3 come from rank 0 alone, 4-7 from rank 1 alone.
    pieces = {rank: {n: d for n, d, _ in by_rank[rank]["pieces"]} for rank in (0, 1)}
    for expert in range(NUM_EXPERTS):
        name = f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"
        owner = 0 if expert < NUM_EXPERTS // 2 else 1
        assert pieces[owner][name] is not None and pieces[1 - owner][name] is None, name


def test_the_reference_takes_a_state_under_checkpoint_names(tmp_path, checkpoint):
    """`reference_generate` given the per-expert state the trainer sends answers as the model
    whose grouped parameters hold the same values; a state lacking an expert is refused."""
    from weightsync.apps.models import make_tiny_model
    from weightsync.apps.reference import reference_generate

    path = make_tiny_model(str(tmp_path / "m"), arch="qwen3_moe", seed=3)
    model = build_model("qwen3_moe", "tiny", seed=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = reference_generate(path, model.state_dict(), prompts, max_new_tokens=4)
    got = reference_generate(path, checkpoint, prompts, max_new_tokens=4)
    assert got == want
    lacking = {k: v for k, v in checkpoint.items() if ".experts.3.up_proj" not in k}
    with pytest.raises(ValueError, match="does not load as a checkpoint"):
        reference_generate(path, lacking, prompts, max_new_tokens=4)
