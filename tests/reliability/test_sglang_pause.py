"""SGLang's HTTP server paused while parameters are written: clients that call the server
directly never get an answer decoded on half-written weights or on two versions."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray

from tests.engine_checks import prompt_ids
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
)
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher

NAME = "sglang-http"
NUM_SYNCS = 30
IDLE_TIMEOUT_S = 20.0  # the engine's: an update whose sender is silent this long is aborted


def _trainer(model: str, **options) -> launcher.TrainerGroup:
    """A 2-rank FSDP2 trainer over 1 MiB buckets, and `options`."""
    return launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        **options,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(
        "weightsync.backends.sglang.engine.SglEngineActor",
        model,
        mode="http",
        idle_timeout_s=IDLE_TIMEOUT_S,
    )
    trainer = _trainer(model)
    trainer.call("connect", {NAME: engine})
    yield engine, trainer, model
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _generate(base: str, key: str, prompt: list[int]):
    """A greedy /generate request with its tokens' log-probs."""
    return post_json(
        base,
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": MAX_NEW_TOKENS,
                "ignore_eos": True,
            },
        },
        api_key=key,
    )


def _hammer(engine) -> Hammer:
    base, key = engine_server(engine)

    def ask(prompt: list[int]):
        return _generate(base, key, prompt)

    def parse(out):
        meta = out["meta_info"]
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None, meta.get("weight_version")
        return [int(p[1]) for p in meta["output_token_logprobs"]], meta.get("weight_version")

    return Hammer(ask, parse)


def test_one_copy_http_clients_never_see_half_written_weights_during_many_syncs(setup):
    """The first sync goes by buckets, then the engine's parameters are shared (the probe
    writes random bytes into them) and every later sync writes them in place."""
    engine, trainer, _ = setup
    start = time.monotonic()
    hammer = _hammer(engine)
    run = run_syncs_under_requests(trainer, NAME, hammer, num_syncs=NUM_SYNCS)
    assert run["paths"][0] == "buckets" and set(run["paths"][1:]) == {"one_copy"}, run["paths"]
    # SGLang tags each answer with its weight version: "default" before the first sync.
    counts = check_answers(
        hammer, run["refs"], run["windows"], tag_of=lambda v: f"v{v}" if v else "default"
    )
    assert counts["tagged"] == counts["complete"]
    print(f"{NUM_SYNCS} syncs, {counts}, {time.monotonic() - start:.0f} s")


def test_an_aborted_update_resumes_the_servers_generation(setup):
    """A request sent straight to the server while an update is open (a bucket loaded,
    keep_previous on) waits; the sender's `abort` puts the previous weights back and resumes
    the server, which answers it on them."""
    engine, trainer, _ = setup
    version = ray.get(engine.engine_weight_version.remote())  # SGLang's own tag
    _, tag = check_a_request_waits_for_the_open_update(
        engine,
        trainer,
        _hammer(engine),
        lambda: ray.get(engine.abort.remote("the trainer gave up"), timeout=120),
    )
    assert tag == version


def test_a_half_written_update_is_refused_to_the_servers_own_clients_until_a_sync(setup):
    """An update aborted after loading a tensor, without keep_previous: the server answers its
    own clients (direct requests) 503 naming the aborted update until the next sync lands."""
    engine, trainer, _ = setup
    check_a_half_written_update_is_refused_to_the_servers_clients(
        engine, trainer, _hammer(engine), "sglang", NAME
    )


def test_a_silent_update_is_expired_by_the_watchdog_and_the_server_resumes(setup):
    """Nobody calls the actor after `begin` and one bucket (a dead trainer): the watchdog
    aborts the update after idle_timeout_s, puts the previous weights back (keep_previous on)
    and resumes the server; the waiting request is answered on them, and the next sync lands
    verified."""
    engine, trainer, _ = setup
    version = ray.get(engine.engine_weight_version.remote())  # SGLang's own tag
    waited_s, tag = check_a_request_waits_for_the_open_update(
        engine, trainer, _hammer(engine), lambda: None, wait_s=IDLE_TIMEOUT_S + 60
    )
    print(f"answered {waited_s:.1f} s after begin (idle_timeout_s {IDLE_TIMEOUT_S:g})")
    assert IDLE_TIMEOUT_S <= waited_s < IDLE_TIMEOUT_S + 60
    assert tag == version
    assert ray.get(engine.engine_weight_version.remote()) == version
    report = trainer.call("sync", "after-watchdog", verify=True)
    assert report["verify"][NAME]["verified"], report["verify"]


def _served(engine) -> list[list[int]]:
    """Greedy tokens of `prompt_ids()`, asked of the server directly as a client would."""
    base, key = engine_server(engine)
    tokens = []
    for prompt in prompt_ids():
        status, out = _generate(base, key, prompt)
        assert status == 200, out
        tokens.append([int(p[1]) for p in out["meta_info"]["output_token_logprobs"]])
    return tokens


def test_the_probe_scores_the_staged_weights_through_the_servers_closed_gate(setup):
    """A trainer that probes syncs into the HTTP server (started through weightsync's serve
    module, which runs the gate): the probe's request alone passes the gate while the update
    is open (tests/reliability/hammer.py)."""
    engine, trainer, model = setup
    check_probes_through_the_gate(
        engine,
        model,
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        lambda: _served(engine),
        trainer,
    )


WORKER = "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker"


def _spans_hammer(engine, versions: dict[str, int]) -> Hammer:
    """Greedy /generate requests; each answer tagged with the JSON of its version spans
    [[version index (`versions[tag]`), start, end], ...] (SGLang's `weight_versions`)."""
    base, key = engine_server(engine)

    def ask(prompt: list[int]):
        return _generate(base, key, prompt)

    def parse(out):
        meta = out["meta_info"]
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None, None
        tokens = [int(p[1]) for p in meta["output_token_logprobs"]]
        spans = meta.get("weight_versions") or [
            {"version": meta["weight_version"], "start": 0, "end": len(tokens)}
        ]
        return tokens, json.dumps(
            [[versions.get(s["version"], -1), s["start"], s["end"]] for s in spans]
        )

    return Hammer(ask, parse)


def test_staged_syncs_serve_on_and_switch_in_one_short_pause(setup):
    """A trainer with `staged=True` syncs (verified) while clients call the server: no
    request waits for a sync's transfer, and every answer's tokens are those of the versions
    SGLang tags them with. A request in flight across a switch is retracted and goes on from
    its tokens so far on the new weights: its later span holds the new version's greedy
    choices. Each sync reports its one pause (`pause_s`) and when it switched."""
    engine, _, model = setup
    check_staged_syncs_under_requests(engine, model, WORKER, _spans_hammer)


def test_a_server_its_owner_paused_stays_paused_through_a_staged_switch(setup):
    """The server's owner pauses generation (SGLang's own /pause_generation); a staged,
    verified sync switches the weights meanwhile and leaves the server paused: a request sent
    after it waits until the owner's /continue_generation, then is answered on the new
    version."""
    engine, _, model = setup
    base, key = engine_server(engine)
    staged = _trainer(model, staged=True, verify=True)
    answers: list = []
    asked = threading.Thread(
        target=lambda: answers.append(_generate(base, key, prompt_ids()[0])), daemon=True
    )
    try:
        staged.call("connect", {NAME: engine})
        staged.call("set_weights_from", 31)
        status, out = post_json(base, "/pause_generation", {"mode": "retract"}, api_key=key)
        assert status == 200, out
        try:
            report = staged.sync("owner-paused-1")
            assert report.verify[NAME].verified and report.engines[NAME].switched_at > 0
            asked.start()
            asked.join(3)
            assert asked.is_alive() and not answers  # still paused
        finally:
            status, out = post_json(base, "/continue_generation", {}, api_key=key)
        assert status == 200, out
        asked.join(120)
        assert answers and answers[0][0] == 200, answers
        assert answers[0][1]["meta_info"]["weight_version"] == "owner-paused-1", answers
    finally:
        staged.kill()


def test_a_staged_update_serves_the_current_weights_and_an_abort_keeps_them(setup):
    """While a staged update is open the server answers, on the weights it served (SGLang's
    own update calls would hold the request until the update closed: here only the abort
    closes it, after the answer came); the abort leaves weights and version tag as they were."""
    engine, _, _ = setup
    version = ray.get(engine.engine_weight_version.remote())
    before = _served(engine)
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(_served(engine)), daemon=True)
    ray.get(engine.begin.remote("staged-open", False, "a test", True), timeout=120)
    try:
        client.start()
        client.join(timeout=120)
    finally:
        ray.get(engine.abort.remote("the test gave up", "a test"), timeout=120)
    assert answers == [before], "no answer while the staged update was open"
    assert ray.get(engine.engine_weight_version.remote()) == version
    assert _served(engine) == before


def test_a_staged_sync_that_fails_verification_is_seen_by_no_request(setup):
    """Clients call the server while a staged, verified sync whose check fails (planted on
    the sender's side: the engine holds the new bytes when checked) is aborted before the
    switch: every answer, before, during and after it, is the served version's, tagged so."""
    engine, trainer, _ = setup
    version = ray.get(engine.engine_weight_version.remote())
    check_a_failed_staged_sync_is_seen_by_no_request(
        engine, trainer, NAME, _spans_hammer(engine, {version: 0}), _served(engine)
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
        _spans_hammer(engine, {version: 0}),
        _served(engine),
        lambda: ray.get(engine.engine_weight_version.remote(), timeout=120),
    )


def test_a_staged_sync_that_kept_the_previous_weights_is_reverted_under_requests(setup):
    """Over HTTP (weightsync's switch route with the loader's "revert"), while clients call
    the server: after staged syncs with `keep_previous`, `TrainerSync.revert` puts the previous
    weights and version tag back in one short pause (requests in flight retracted, as at a
    switch, and computed again on the previous version); every answer's tokens are those of
    the versions SGLang tags them with, every answer sent after it is the previous version's,
    and a second revert is refused, naming why (tests/reliability/hammer.py). (Last in the
    module: the engine keeps `keep_previous` on.)"""
    engine, _, model = setup
    check_a_revert_under_requests(engine, model, WORKER, NAME, _spans_hammer)
