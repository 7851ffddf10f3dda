"""The log-prob probe against loader faults planted in the real SGLang engine's own loaders.

A tiny OPT (SGLang on this CPU runs only models without rotary embeddings, at TP=1; q/k
sharpened as a trained model's attention is) in a framework's own in-process `sglang.Engine`
(tests/sglang/planted.py), synced from a 1-rank FSDP2 trainer with verification and the probe.
From the first sync, SGLang's loader of one layer-0 parameter is wrapped wrong: q and k swapped
inside qkv_proj, out_proj transposed, fc2 dropped. The probe fails the first two before commit
(fingerprints pass them: the placements are learned from the same loader); the dropped tensor's
parameter holds nothing the trainer sent, so verification fails it first, naming it. Each update
is rolled back (keep_previous), and the engine still serves the checkpoint's weights. Each fault
meets a receiver that has seen no sync, connected under the fault's name (tests/planted_faults.py). With SGLang's loaders
put back, the same trainer syncs, the probe passes (float32: a mean gap below 1e-3, decode steps
within 1e-2) and the engine's
greedy tokens equal the trainer's reference. OPT has no gate/up projection: that fault runs
on vLLM only (tests/vllm/test_vllm_probe.py)."""

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
from tests.sglang.planted import KINDS
from weightsync.driver import launcher

ROLLOUT = "tests.sglang.planted.PlantedEngine"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = sharp_checkpoint("opt", str(tmp_path_factory.mktemp("opt-sharp")))
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "sglang")
    rollout = launcher.launch(ROLLOUT, path)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=path,
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        probe={"bound": 1e-3, "length": 24},
    )
    yield run_planted(trainer, rollout, KINDS)
    trainer.kill()
    ray.get(rollout.shutdown.remote(), timeout=120)
    ray.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_fault_planted_from_the_first_sync_is_caught_before_commit(planted, kind):
    check_caught(planted, kind, engine="sglang", dropped_param="layers.0.fc2.weight")


def test_with_sglangs_loaders_back_the_probe_passes_and_tokens_equal_the_reference(planted):
    check_right(planted, decode_max=1e-2)  # SGLang-cpu's decode: 2.2e-3 from the trainer


def test_the_framework_actor_refuses_its_own_generation_mid_update_and_takes_the_one_copy_path(
    planted,
):
    check_framework_actor(planted)
