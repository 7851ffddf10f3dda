"""SGLang as an HTTP server (loopback, API key) serving GPT-2 (transposed Conv1D, tied head),
fed by a 2-rank FSDP2 trainer through the non-colocated path: a gloo broadcast group."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import (
    check_repeated_syncs,
    check_server_on_loopback_demands_key,
    check_sync_after_training,
)
from weightsync.apps.models import make_tiny_model
from weightsync.launch import launcher


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="gpt2", seed=0)
    launcher.init_ray(num_cpus=2)
    # No api_key given: the actor makes one up (vllm's server test passes its own).
    engine = launcher.launch("weightsync.backends.sglang.engine.SglEngineActor", model, mode="http")
    trainer = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        transport="gloo",
    )
    trainer.call("connect", {"sglang-http": engine})
    yield engine, trainer
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def test_gpt2_over_http_and_gloo_is_verified_and_matches_reference(setup):
    engine, trainer = setup
    check_sync_after_training(engine, trainer, "sglang-http", "http-1", steps=2)
    assert ray.get(engine.engine_weight_version.remote()) == "http-1"  # SGLang's own tag


def test_repeated_syncs_over_http_with_requests_in_between(setup):
    engine, trainer = setup
    check_repeated_syncs(engine, trainer, "sglang-http", "http-round", rounds=2)


def test_server_listens_on_loopback_and_demands_a_key_by_default(setup):
    engine, _ = setup
    key = ray.get(engine.server_api_key.remote())
    assert isinstance(key, str) and len(key) >= 24
    check_server_on_loopback_demands_key(
        engine,
        [
            "/update_weights_from_tensor",
            "/pause_generation",
            "/continue_generation",
            "/update_weight_version",
            "/generate",
        ],
        key=key,
        get_path="/model_info",
    )
