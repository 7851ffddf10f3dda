"""vLLM's OpenAI-compatible server (loopback, API key) serving GPT-2 (transposed Conv1D, tied head),
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

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="gpt2", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(
        "weightsync.backends.vllm.engine.VllmEngineActor", model, mode="http", api_key=API_KEY
    )
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        transport="gloo",
    )
    trainer.call("connect", {"vllm-http": engine})
    yield engine, trainer
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def test_gpt2_over_http_and_gloo_is_verified_and_matches_reference(setup):
    engine, trainer = setup
    check_sync_after_training(engine, trainer, "vllm-http", "http-1", steps=2)


def test_repeated_syncs_over_http_with_requests_in_between(setup):
    engine, trainer = setup
    check_repeated_syncs(engine, trainer, "vllm-http", "http-round", rounds=2)


def test_server_listens_on_loopback_and_demands_the_api_key(setup):
    """Every route weightsync drives demands the key, not only vLLM's own /v1 routes."""
    engine, _ = setup
    assert ray.get(engine.server_api_key.remote()) == API_KEY
    check_server_on_loopback_demands_key(
        engine,
        [
            "/v1/completions",
            "/collective_rpc",
            "/pause",
            "/resume",
            "/update_weight_version",
            "/reset_prefix_cache",
        ],
        key=API_KEY,
        get_path="/v1/models",
    )
