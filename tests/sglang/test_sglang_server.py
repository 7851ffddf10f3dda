"""SGLang as an HTTP server (loopback, API key) serving GPT-2 (transposed Conv1D, tied head),
fed by a 2-rank FSDP2 trainer through the non-colocated path: a gloo broadcast group."""

from __future__ import annotations

import json
import math

import pytest
import ray

from tests.engine_checks import (
    check_repeated_syncs,
    check_server_on_loopback_demands_key,
    check_sync_after_training,
    prompt_ids,
)
from weightsync.apps.models import make_tiny_model, make_tokenizer
from weightsync.driver import launcher
from weightsync.engine.server import http_json


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
            "/weightsync/gate",
            "/weightsync/staged",
            "/weightsync/switch",
        ],
        key=key,
        get_path="/model_info",
    )


def test_the_staged_route_passes_on_a_staged_updates_ops_only(setup):
    """weightsync's route for a staged update's calls (sent without SGLang's writer lock) takes
    a JSON control message and refuses, before any scheduler sees it, an op that writes the
    served weights (a plain load, a rollback) or is not JSON."""
    engine, _ = setup
    base, key = ray.get(engine.server_url.remote()), ray.get(engine.server_api_key.remote())
    for message in (
        json.dumps({"op": "rollback", "reply": "/nonexistent"}),
        json.dumps({"op": "commit", "reply": "/nonexistent"}),
        "not json",
    ):
        status, out = http_json(
            "POST", base + "/weightsync/staged", {"op": "update", "message": message}, api_key=key
        )
        assert status == 400, (message, status, out)
    status, out = http_json(
        "POST",
        base + "/weightsync/switch",
        {"message": json.dumps({"op": "load"}), "version": "x"},
        api_key=key,
    )
    assert status == 400, (status, out)


def test_sampling_options_reach_the_server_and_its_finish_reasons_come_back(setup):
    engine = setup[0]
    prompt = prompt_ids()[:1]
    free = ray.get(
        engine.generate.remote(prompt, max_new_tokens=6, ignore_eos=True, top_logprobs=2)
    )
    assert [len(t) for t in free["tokens"]] == [6] and free["finish_reasons"] == ["length"]
    tokens = free["tokens"][0]
    # Greedy: each token is the likeliest. Compared by log-probability, since the weights of
    # `set_weights_from` repeat across the trainer's shards, so tokens i and i + 160 can tie.
    for step, logprob in zip(free["top_logprobs"][0], free["logprobs"][0], strict=True):
        assert len(step) == 2 and math.isclose(step[0][1], logprob, abs_tol=1e-6)
        assert step[0][1] >= step[1][1]
    # Ends at the first of the stop token or the model's EOS in the free-running sample.
    stop = tokens[2]
    end = min(tokens.index(t) for t in (stop, make_tokenizer().eos_token_id) if t in tokens) + 1
    out = ray.get(engine.generate.remote(prompt, max_new_tokens=6, stop_token_ids=[stop]))
    assert out["tokens"] == [tokens[:end]] and out["finish_reasons"] == ["stop"]
