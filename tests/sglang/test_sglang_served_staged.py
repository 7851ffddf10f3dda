"""An SGLang server started the way a framework starts one for staged updates: weightsync's
server module (`python -m weightsync.backends.sglang.serve`, SGLang's own flags, its key in the
environment), attached by URL. A staged switch holds generation: the owner's own
/pause_generation or /continue_generation sent meanwhile waits for the switch's end, so the
switch neither undoes the owner's pause nor is released midway by the owner's continue. The
switch is made to last 3 s by a loader planted in the server's scheduler
(tests/sglang/planted.py `plant_slow_switch`)."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids
from tests.sglang.planted import SLOW_SWITCH
from weightsync.apps.models import make_tiny_model
from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS
from weightsync.backends.sglang.loader import LOADER
from weightsync.backends.sglang.serve import KEY_VARIABLE
from weightsync.driver import launcher
from weightsync.engine.server import LocalServer, cli_flags, http_json
from weightsync.wire.protocol import SyncReport

KEY = "served-staged-key-2718"
ACTOR = "weightsync.backends.sglang.engine.SglEngineActor"
WORKER = "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    command = [sys.executable, "-m", "weightsync.backends.sglang.serve", "--model-path", model]
    command += ["--dtype", "float32", *cli_flags(CPU_ENGINE_ARGS)]
    command += ["--custom-weight-loader", LOADER, SLOW_SWITCH]
    started = LocalServer(command, name="sglang", api_key=KEY, env={KEY_VARIABLE: KEY})
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    yield engine, started, model
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()
    started.shutdown()


def _plant_slow_switch(
    started: LocalServer, seconds: float, marker: Path, *, fail: str | None = None
) -> list:
    """`plant_slow_switch` in every scheduler, through SGLang's own update route."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    reply = tempfile.mkdtemp(prefix="weightsync-plant-")
    message = json.dumps({"seconds": seconds, "marker": str(marker), "fail": fail, "reply": reply})
    payload = MultiprocessingSerializer.serialize([(message, torch.empty(0))], output_str=True)
    for path, body in (
        ("/begin_weight_update", {"selector": "all"}),
        (
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [payload],
                "load_format": SLOW_SWITCH,
                "flush_cache": False,
            },
        ),
        ("/end_weight_update", {}),
    ):
        status, out = http_json("POST", started.base + path, body, api_key=KEY)
        assert status == 200, (path, out)
    return [json.loads(p.read_text()) for p in sorted(Path(reply).iterdir())]


def _completions(started: LocalServer) -> list[list[int]]:
    """Greedy completions (token ids) of the test prompts from the server's /generate."""
    status, out = http_json(
        "POST",
        started.base + "/generate",
        {
            "input_ids": prompt_ids(),
            "sampling_params": {
                "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
        api_key=KEY,
        timeout=300,
    )
    assert status == 200, out
    # (logprob, token id, text) per generated token
    return [[int(p[1]) for p in o["meta_info"]["output_token_logprobs"]] for o in out]


def _trainer(model: str, **options) -> launcher.TrainerGroup:
    """A one-rank FSDP2 trainer that syncs staged and verified, and `options`."""
    return launcher.TrainerGroup(
        WORKER,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        world_size=1,
        staged=True,
        verify=True,
        timeout_s=240,
        **options,
    )


def _version(started: LocalServer) -> str | None:
    status, out = http_json("GET", started.base + "/model_info", api_key=KEY)
    assert status == 200, out
    return out.get("weight_version")


@pytest.mark.parametrize("where", ["before", "midway"])
def test_a_switch_that_fails_in_the_servers_scheduler_fails_the_sync_and_the_actor_refuses_to_serve(
    served, tmp_path, where
):
    """Staged, verified syncs into the server. Its scheduler's switch failing (planted
    through SGLang's own update route, before it copies anything, or after half of the
    parameters switched) fails the sync with the scheduler's words; the server's weight
    version stays the last whole one, and the actor refuses to generate until a sync
    completes, and so does the server, to its own clients (503). The next staged sync switches
    every parameter (the copy a failed switch left is made again), and the server answers
    with the trainer's weights."""
    engine, started, model = served
    trainer = _trainer(model)
    marker = tmp_path / "switching"
    try:
        trainer.call("connect", {"planted": engine})
        trainer.call("set_weights_from", 51 if where == "before" else 54)
        assert trainer.sync(f"planted-{where}-1").verify["planted"].verified
        assert _version(started) == f"planted-{where}-1"
        trainer.call("set_weights_from", 52)
        assert _plant_slow_switch(started, 0.0, marker, fail=where) == [
            {"planted": 0.0, "fail": where}
        ]
        try:
            with pytest.raises(Exception, match=f"planted: this scheduler's switch failed {where}"):
                trainer.sync(f"planted-{where}-2")
        finally:
            _plant_slow_switch(started, 0.0, marker)
        assert _version(started) == f"planted-{where}-1"
        with pytest.raises(
            Exception, match=f"does not serve: update 'planted-{where}-2' was aborted"
        ):
            ray.get(engine.generate.remote(prompt_ids()[:1], max_new_tokens=2), timeout=300)
        # The server's own clients are refused too (a direct request, as theirs).
        status, out = http_json(
            "POST",
            started.base + "/generate",
            {"input_ids": prompt_ids()[:1], "sampling_params": {"max_new_tokens": 2}},
            api_key=KEY,
            timeout=300,
        )
        assert status == 503, (status, out)
        want = f"sglang engine does not serve: update 'planted-{where}-2' was aborted"
        assert want in out["error"], out
        trainer.call("set_weights_from", 53 if where == "before" else 55)
        assert trainer.sync(f"planted-{where}-3").verify["planted"].verified
        assert _version(started) == f"planted-{where}-3"
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert _completions(started) == want["tokens"]
    finally:
        trainer.kill()


def test_with_keep_previous_a_switch_that_fails_partway_is_undone_and_the_server_serves_on(
    served, tmp_path
):
    """With `keep_previous=True` the scheduler's switch swaps the served weights with the
    staged copy. Its copying failing partway, after writing the served parameters (planted
    in weightsync's copies in the scheduler), is undone there: the sync fails saying so, the
    server's version stays, its own clients get the previous version's tokens, the actor
    serves on, and the next staged sync serves the trainer's weights. A revert whose swap back
    fails partway is undone the same way: the server serves on with the current version, and
    the revert asked again serves the previous one."""
    engine, started, model = served
    trainer = _trainer(model, keep_previous=True)
    marker = tmp_path / "switching"
    try:
        trainer.call("connect", {"kept": engine})
        trainer.call("set_weights_from", 61)
        assert trainer.sync("kept-1").verify["kept"].verified
        before = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert _completions(started) == before["tokens"]
        trainer.call("set_weights_from", 62)
        assert _plant_slow_switch(started, 0.0, marker, fail="partway") == [
            {"planted": 0.0, "fail": "partway"}
        ]
        try:
            with pytest.raises(Exception, match="failed partway in every scheduler and was undone"):
                trainer.sync("kept-2")
        finally:
            _plant_slow_switch(started, 0.0, marker)
        assert _version(started) == "kept-1"
        assert _completions(started) == before["tokens"]
        assert ray.get(engine.generate.remote(prompt_ids()[:1], max_new_tokens=2), timeout=300)
        trainer.call("set_weights_from", 63)
        assert trainer.sync("kept-3").verify["kept"].verified
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert _version(started) == "kept-3" and _completions(started) == want["tokens"]

        # A revert whose swap back fails partway is undone too, and can be asked again.
        _plant_slow_switch(started, 0.0, marker, fail="partway")
        try:
            with pytest.raises(Exception, match="failed partway in every scheduler and was undone"):
                trainer.call("revert")
        finally:
            _plant_slow_switch(started, 0.0, marker)
        assert _version(started) == "kept-3" and _completions(started) == want["tokens"]
        assert trainer.call("revert")["kept"]["weight_version"] == "kept-1"
        assert _version(started) == "kept-1" and _completions(started) == before["tokens"]
    finally:
        ray.get(engine.set_keep_previous.remote(False), timeout=300)
        trainer.kill()


@pytest.mark.parametrize("route", ["pause", "continue"])
def test_an_owners_pause_or_continue_sent_during_a_switch_waits_for_its_end(
    served, tmp_path, route
):
    """The owner's /pause_generation or /continue_generation arriving while a staged switch
    holds generation (the switch made to last 3 s) is answered only after the switch ended. A
    pause then holds: the switch's end does not undo it, a request sent after the sync waits
    until the owner's /continue_generation, and is then answered on the trainer's weights. A
    continue does not release the switch midway: the server serves on afterwards, the
    trainer's weights."""
    engine, started, model = served
    trainer = _trainer(model)
    marker = tmp_path / "switching"
    try:
        trainer.call("connect", {"mid-switch": engine})
        trainer.call("set_weights_from", 41 if route == "pause" else 42)
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert _plant_slow_switch(started, 3.0, marker) == [{"planted": 3.0, "fail": None}]
        try:
            call = trainer.submit("sync", f"mid-switch-{route}")
            deadline = time.monotonic() + 240
            while not marker.exists():  # the switch has begun: generation is held
                assert time.monotonic() < deadline, "the sync never reached its switch"
                time.sleep(0.02)
            path = "/pause_generation" if route == "pause" else "/continue_generation"
            body = {"mode": "in_place"} if route == "pause" else {}
            status, out = http_json("POST", started.base + path, body, api_key=KEY)
            answered_at = time.time()
            assert status == 200, out
            report = SyncReport.from_dict(call.result())
        finally:
            _plant_slow_switch(started, 0.0, marker)
        part = report.engines["mid-switch"]
        assert report.verify["mid-switch"].verified
        assert answered_at >= part.switched_at, (answered_at, part.switched_at)
        if route == "pause":
            answers: list = []
            asking = threading.Thread(target=lambda: answers.append(_completions(started)))
            asking.start()
            asking.join(5.0)
            assert asking.is_alive() and not answers, "the owner's pause was undone"
            status, out = http_json("POST", started.base + "/continue_generation", {}, api_key=KEY)
            assert status == 200, out
            asking.join(300)
            assert answers, "no answer after the owner's continue"
            got = answers[0]
        else:
            got = _completions(started)
        assert got == want["tokens"]
    finally:
        http_json("POST", started.base + "/continue_generation", {}, api_key=KEY)
        trainer.kill()
