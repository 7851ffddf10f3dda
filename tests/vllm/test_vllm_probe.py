"""The log-prob probe against loader faults planted in the real vLLM engine's own loaders.

A Qwen2-shaped model (rope, GQA, untied head; q/k sharpened as a trained model's attention is)
in a framework's own in-process `vllm.LLM` (tests/vllm/planted.py) on two tensor-parallel
workers, synced from a 1-rank FSDP2 trainer with verification and the probe. From the first sync, vLLM's loader of one layer-0 parameter is wrapped wrong: q and k
swapped inside qkv, o_proj transposed, down_proj dropped, gate and up swapped. Fingerprints pass
the swaps and the transpose (placements are learned from the same loader) and the probe fails
each before commit; the dropped tensor's parameter holds nothing the trainer sent, so
verification fails it first, naming it (the probe alone catches a dropped tensor too:
tests/core/test_probe.py). Each update is rolled back (keep_previous), and the engine still
serves the checkpoint's weights. Each fault meets a receiver that has seen no sync (the
loader is learned on first sight), connected under the fault's name. With
vLLM's loaders put back, the same trainer syncs, the probe passes (a float32 gap below 1e-4),
and the engine's greedy tokens equal the trainer's reference."""

from __future__ import annotations

import pytest
import ray

from tests.planted_faults import (
    check_caught,
    check_framework_actor,
    check_right,
    run_planted,
    sharp_checkpoint,
)
from tests.vllm.planted import KINDS
from weightsync.driver import launcher

ROLLOUT = "tests.vllm.planted.PlantedRollout"


# Two tensor-parallel workers (the probe's forward takes both; TP=1 took the same path in
# 2.5 min more of CI: the project's receiver covers one worker in tests/core/test_probe.py).
@pytest.fixture(scope="module", params=[2], ids=["tp2"])
def planted(request, tmp_path_factory):
    path = sharp_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2-sharp")))
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "*vllm")
    rollout = launcher.launch(ROLLOUT, path, request.param)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        # One rank: the probe from a 2-rank FSDP2 trainer runs in tests/core/test_probe.py.
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        probe={"bound": 1e-3, "length": 24},
    )
    yield run_planted(trainer, rollout, KINDS)
    trainer.kill()
    ray.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_fault_planted_from_the_first_sync_is_caught_before_commit(planted, kind):
    check_caught(planted, kind, engine="vllm", dropped_param="layers.0.mlp.down_proj.weight")


def test_with_vllms_loaders_back_the_probe_passes_and_tokens_equal_the_reference(planted):
    check_right(planted)


def test_the_framework_actor_refuses_its_own_generation_mid_update_and_takes_the_one_copy_path(
    planted,
):
    check_framework_actor(planted)
