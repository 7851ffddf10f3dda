"""vLLM's HTTP server paused while parameters are written: clients that call the server
directly never get an answer decoded on half-written weights or on two versions."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import ray

from tests.engine_checks import (
    check_server_on_loopback_demands_key,
    prompt_ids,
)
from tests.reliability.hammer import (
    MAX_NEW_TOKENS,
    Hammer,
    check_a_failed_staged_sync_is_seen_by_no_request,
    check_a_half_written_update_is_refused_to_the_servers_clients,
    check_a_request_waits_for_the_open_update,
    check_a_revert_under_requests,
    check_a_staged_sync_failing_its_probe_is_seen_by_no_request,
    check_answers,
    check_probes_through_the_gate,
    check_staged_syncs_under_requests,
    engine_server,
    post_json,
    run_syncs_under_requests,
    vllm_spans_hammer,
)
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher

NAME = "vllm-http"
NUM_SYNCS = 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model, mode="http")
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
    )
    trainer.call("connect", {NAME: engine})
    yield engine, trainer, model
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _hammer(engine, model: str) -> Hammer:
    """Requests alternate between vLLM's OpenAI /v1/completions and its scale-out
    /inference/v1/generate, whose answers carry the weight version of every token."""
    base, key = engine_server(engine)
    turn = itertools.count()

    def ask(prompt: list[int]):
        if next(turn) % 2:
            return post_json(
                base,
                "/inference/v1/generate",
                {
                    "token_ids": prompt,
                    "sampling_params": {
                        "temperature": 0.0,
                        "max_tokens": MAX_NEW_TOKENS,
                        "ignore_eos": True,
                    },
                },
                api_key=key,
            )
        return _complete(base, key, model, prompt)

    def parse(out):
        choice = out["choices"][0]
        if choice.get("finish_reason") == "abort":
            return None, None
        if "weight_versions" not in choice:  # /v1/completions: untagged
            return [int(t.split(":")[-1]) for t in choice["logprobs"]["tokens"]], None
        tokens = choice["token_ids"]
        spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"] or []]
        # One version for all tokens; anything else is reported as the tag and fails.
        whole = len(spans) == 1 and spans[0][1:] == (0, len(tokens))
        return tokens, spans[0][0] if whole else f"spans {spans}"

    return Hammer(ask, parse)


def _complete(base: str, key: str, model: str, prompt: list[int]) -> tuple[int, Any]:
    """A greedy /v1/completions request, its tokens as ids."""
    return post_json(
        base,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "logprobs": 1,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
        api_key=key,
    )


def test_one_copy_http_clients_never_see_half_written_weights_during_many_syncs(setup):
    """The first sync goes by buckets, then the engine's parameters are shared (the probe
    writes random bytes into them) and every later sync writes them in place."""
    engine, trainer, model = setup
    start = time.monotonic()
    hammer = _hammer(engine, model)
    run = run_syncs_under_requests(trainer, NAME, hammer, num_syncs=NUM_SYNCS)
    assert run["paths"][0] == "buckets" and set(run["paths"][1:]) == {"one_copy"}, run["paths"]
    # vLLM tags each token with its weight version: "default" before the first sync.
    counts = check_answers(
        hammer, run["refs"], run["windows"], tag_of=lambda v: f"v{v}" if v else "default"
    )
    assert counts["tagged"] > 0
    print(f"{NUM_SYNCS} syncs, {counts}, {time.monotonic() - start:.0f} s")


def test_an_aborted_update_resumes_the_servers_generation(setup):
    """A request sent while an update is open (a bucket loaded, keep_previous on) waits; the
    sender's `abort` puts the previous weights back and resumes the server, which answers it
    on them."""
    engine, trainer, model = setup
    check_a_request_waits_for_the_open_update(
        engine,
        trainer,
        _hammer(engine, model),
        lambda: ray.get(engine.abort.remote("the trainer gave up"), timeout=120),
    )


def test_a_half_written_update_is_refused_to_the_servers_own_clients_until_a_sync(setup):
    """An update aborted after loading a tensor, without keep_previous: the server answers its
    own clients (direct requests) 503 naming the aborted update until the next sync lands."""
    engine, trainer, model = setup
    check_a_half_written_update_is_refused_to_the_servers_clients(
        engine, trainer, _hammer(engine, model), "vllm", NAME
    )


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


def test_server_listens_on_loopback_and_demands_the_api_key(setup):
    """Every route weightsync drives demands the key, not only vLLM's own /v1 routes."""
    engine = setup[0]
    key = ray.get(engine.server_api_key.remote())
    assert isinstance(key, str) and len(key) >= 24  # none given: the actor made one up
    check_server_on_loopback_demands_key(
        engine,
        [
            "/v1/completions",
            "/collective_rpc",
            "/pause",
            "/resume",
            "/update_weight_version",
            "/reset_prefix_cache",
            "/weightsync/gate",
            "/weightsync/switch",
        ],
        key=key,
        get_path="/v1/models",
    )


def _served(engine, model: str) -> list[list[int]]:
    """Greedy tokens of `prompt_ids()`, asked of the server directly as a client would."""
    base, key = engine_server(engine)
    tokens = []
    for prompt in prompt_ids():
        status, out = _complete(base, key, model, prompt)
        assert status == 200, out
        tokens.append([int(t.split(":")[-1]) for t in out["choices"][0]["logprobs"]["tokens"]])
    return tokens


def test_the_probe_scores_the_staged_weights_through_the_servers_closed_gate(setup):
    """A trainer that probes syncs into the HTTP server: the probe's request alone passes
    weightsync's gate while the update is open (tests/reliability/hammer.py)."""
    engine, trainer, model = setup
    check_probes_through_the_gate(
        engine,
        model,
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        lambda: _served(engine, model),
        trainer,
    )


WORKER = "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker"


def test_staged_syncs_serve_on_and_switch_in_one_short_pause(setup):
    """A trainer with `staged=True` syncs (verified) while clients call the server: no
    request waits for a sync's transfer, and every answer's tokens are those of the version
    vLLM tags them with. A request in flight across a switch goes on from its tokens so far on
    the new weights (its KV computed again): its later span equals the new version's greedy
    continuation. Each sync reports its one pause (`pause_s`) and when it switched."""
    engine, _, model = setup
    # Fewer, larger buckets than SGLang's: vLLM runs each staged load between two forward
    # steps, so under the clients a sync takes about its buckets times a step.
    check_staged_syncs_under_requests(
        engine, model, WORKER, vllm_spans_hammer, syncs=6, bucket_bytes=1 << 18
    )


def test_a_staged_update_serves_the_current_weights_and_an_abort_keeps_them(setup):
    """While a staged update is open the server answers, on the weights it served (a paused
    server would hold the request until the update closed: here only the abort closes it,
    after the answer came); the sender's abort leaves weights and version tag as they were."""
    engine, _, model = setup
    version = ray.get(engine.weight_version.remote())
    before = _served(engine, model)
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(_served(engine, model)), daemon=True)
    ray.get(engine.begin.remote("staged-open", False, "a test", True), timeout=120)
    try:
        client.start()
        client.join(timeout=120)
    finally:
        ray.get(engine.abort.remote("the test gave up", "a test"), timeout=120)
    assert answers == [before], "no answer while the staged update was open"
    assert ray.get(engine.weight_version.remote()) == version
    assert _served(engine, model) == before


def test_a_staged_sync_that_fails_verification_is_seen_by_no_request(setup):
    """Clients call the server while a staged, verified sync whose check fails (planted on
    the sender's side: the engine holds the new bytes when checked) is aborted before the
    switch: every answer, before, during and after it, is the served version's, tagged so."""
    engine, trainer, model = setup
    version = ray.get(engine.weight_version.remote())
    check_a_failed_staged_sync_is_seen_by_no_request(
        engine, trainer, NAME, vllm_spans_hammer(engine, {version: 0}), _served(engine, model)
    )


def test_a_staged_sync_that_fails_its_probe_after_the_switch_is_seen_by_no_request(setup):
    """Clients call the server while a staged sync with a probe is switched in and fails its
    probe (planted on the trainer's side): the server holds its new requests from before the
    switch, lets those in flight finish, and answers again only once the engine is switched
    back (keep_previous): every answer is the served version's, tagged so
    (tests/reliability/hammer.py)."""
    engine, trainer, model = setup
    version = trainer.sync("probe-base").engines[NAME].weight_version  # a version of its own
    check_a_staged_sync_failing_its_probe_is_seen_by_no_request(
        engine,
        model,
        WORKER,
        NAME,
        vllm_spans_hammer(engine, {version: 0}),
        _served(engine, model),
        lambda: ray.get(engine.weight_version.remote(), timeout=120),
    )


def test_a_staged_sync_that_kept_the_previous_weights_is_reverted_through_the_server(setup):
    """Over HTTP (weightsync's switch route with "revert"), while clients call the server:
    after staged syncs with `keep_previous`, `TrainerSync.revert` puts the previous weights
    and version tag back in one short pause; every answer's tokens are those of the versions
    the server tags them with (one in flight across the revert goes on, on the previous
    version), every answer sent after it is the previous version's, and a second revert is
    refused, naming why (tests/reliability/hammer.py). (Last in the module: the engine keeps
    `keep_previous` on.)"""
    engine, _, model = setup
    check_a_revert_under_requests(engine, model, WORKER, NAME, vllm_spans_hammer)
