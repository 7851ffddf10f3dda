"""vLLM's HTTP server paused while parameters are written: clients that call the server
directly never get an answer decoded on half-written weights or on two versions."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from tests.engine_checks import prompt_ids
from tests.reliability.hammer import (
    MAX_NEW_TOKENS,
    Hammer,
    check_answers,
    engine_server,
    post_json,
    run_syncs_under_requests,
)
from weightsync import launcher
from weightsync.models import make_tiny_model

NAME = "vllm-http"
NUM_SYNCS = 50


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model,
                             mode="http")
    trainer = launcher.TrainerGroup("weightsync.backends.vllm.worker."
                                    "VllmDTensorV2WeightSyncWorker",
                                    model_path=model, bucket_bytes=1 << 20, seed=0)
    trainer.call("connect", {NAME: engine})
    yield engine, trainer, model
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _hammer(engine, model: str) -> Hammer:
    base, key = engine_server(engine)

    def ask(prompt: list[int]):
        return post_json(base, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
            "return_tokens_as_token_ids": True}, api_key=key)

    def parse(out):
        choice = out["choices"][0]
        if choice.get("finish_reason") == "abort":
            return None, None
        return [int(t.split(":")[-1]) for t in choice["logprobs"]["tokens"]], None

    return Hammer(ask, parse)


def test_direct_http_clients_never_see_half_written_weights_during_many_syncs(setup):
    """The first sync goes by buckets, then the engine's parameters are shared (the probe
    writes random bytes into them) and every later sync writes them in place."""
    engine, trainer, model = setup
    start = time.monotonic()
    hammer = _hammer(engine, model)
    run = run_syncs_under_requests(trainer, NAME, hammer, num_syncs=NUM_SYNCS)
    assert run["paths"][0] == "buckets" and set(run["paths"][1:]) == {"direct"}, run["paths"]
    counts = check_answers(hammer, run["refs"], run["windows"])
    print(f"{NUM_SYNCS} syncs, {counts}, {time.monotonic() - start:.0f} s")


def test_an_aborted_update_resumes_the_servers_generation(setup):
    """A request sent while an update is open waits; the sender's `abort` resumes the server,
    which answers it on the weights it held before (nothing was loaded)."""
    engine, trainer, model = setup
    hammer = _hammer(engine, model)
    prompt = prompt_ids()[0]
    want = trainer.call("reference_generate", [prompt], max_new_tokens=MAX_NEW_TOKENS)["tokens"]
    ray.get(engine.begin.remote("never-ends"), timeout=120)
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(hammer.ask(prompt)), daemon=True)
    try:
        client.start()
        client.join(timeout=5)
        assert not answers, f"answered during an open update: {answers}"
    finally:
        ray.get(engine.abort.remote("the trainer gave up"), timeout=120)
    client.join(timeout=120)
    assert answers, "no answer 120 s after the update was aborted: the server stayed paused"
    status, out = answers[0]
    assert status == 200, out
    assert [hammer.parse(out)[0]] == want


def test_without_an_api_key_the_actor_makes_one_up_and_the_server_demands_it(setup):
    """The engine here was launched without `api_key=`: the actor made one up, the server
    refuses a request without it (401) or with another, and answers one that carries it."""
    engine, _, model = setup
    base, key = engine_server(engine)
    assert len(key) >= 16
    body = {"model": model, "prompt": prompt_ids()[0], "max_tokens": 1, "temperature": 0.0}
    assert post_json(base, "/v1/completions", body, api_key=None)[0] == 401
    assert post_json(base, "/v1/completions", body, api_key=key + "x")[0] == 401
    assert post_json(base, "/v1/completions", body, api_key=key)[0] == 200
