"""vLLM's OpenAI-compatible server (loopback, API key) serving GPT-2 (transposed Conv1D, tied head),
fed by a 2-rank FSDP2 trainer through the non-colocated path: a gloo broadcast group."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import ray

from tests.engine_checks import assert_engine_matches_reference, prompt_ids, training_batch
from weightsync import launcher
from weightsync.models import make_tiny_model

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="gpt2", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("backends.vllm.engine.VllmEngineActor", model, mode="http",
                             api_key=API_KEY)
    trainer = launcher.TrainerGroup("backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
                                    model_path=model, bucket_bytes=1 << 20, seed=0,
                                    transport="gloo")
    trainer.call("connect", {"vllm-http": engine})
    yield engine, trainer
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def test_gpt2_over_http_and_gloo_is_verified_and_matches_reference(setup):
    engine, trainer = setup
    for step in range(2):
        trainer.call("train_step", training_batch(step))
    report = trainer.call("sync", "http-1", verify=True)
    assert report["verify"]["vllm-http"]["verified"], report["verify"]
    assert ray.get(engine.weight_version.remote()) == "http-1"
    assert_engine_matches_reference(engine, trainer)


def test_repeated_syncs_over_http_with_requests_in_between(setup):
    engine, trainer = setup
    for round_ in range(2):
        trainer.call("set_weights_from", 200 + round_)
        report = trainer.call("sync", f"http-round-{round_}", verify=True)
        assert report["verify"]["vllm-http"]["verified"]
        assert ray.get(engine.generate.remote(prompt_ids()))["weight_version"] == \
            f"http-round-{round_}"
        assert_engine_matches_reference(engine, trainer)


def test_server_listens_on_loopback_and_demands_the_api_key(setup):
    engine, _ = setup
    base = ray.get(engine.server_url.remote())
    assert base.startswith("http://127.0.0.1:")
    req = urllib.request.Request(base + "/v1/completions", data=b"{}",
                                 method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
