"""A nemo-automodel trainer (its Qwen2 model class and its FSDP2 parallelizer, 2 ranks over gloo)
keeps a real vLLM engine in step: the DTensorV2 worker with `model_builder="nemo_automodel"`."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import (
    assert_engine_matches_reference,
    check_sync_after_training,
    training_batch,
)
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        model_builder="nemo_automodel",
        bucket_bytes=1 << 20,
        seed=0,
    )
    trainer.call("connect", {"vllm": engine})
    yield engine, trainer
    ray.shutdown()


def test_automodel_trainer_is_nemo_automodels_model_sharded_by_fsdp2(setup):
    _, trainer = setup
    info = trainer.call("model_info")
    assert info["module"].startswith("nemo_automodel.components.models.qwen2")
    assert info["num_dtensor_params"] == info["num_params"] > 0


def test_automodel_qwen2_trainer_syncs_verified_and_vllm_generates_its_reference(setup):
    engine, trainer = setup
    # Rope, grouped-query attention and an untied head; greedy tokens equal the trainer's
    # float32 reference after 3 training steps.
    check_sync_after_training(engine, trainer, "vllm", "automodel-step-3", steps=3)


def test_automodel_trainer_takes_the_one_copy_path_from_the_second_sync(setup):
    engine, trainer = setup
    for round_ in range(2):  # training steps between syncs, as in a training loop
        trainer.call("train_step", training_batch(10 + round_))
        report = trainer.sync(f"automodel-round-{round_}", verify=True)
        assert report.engines["vllm"].path == "one_copy", report
        assert report.verify is not None and report.verify["vllm"].verified, report.verify
        assert ray.get(engine.weight_version.remote()) == f"automodel-round-{round_}"
        assert_engine_matches_reference(engine, trainer)
