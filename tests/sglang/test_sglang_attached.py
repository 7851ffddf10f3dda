"""An SGLang server the framework started itself, with SGLang's own CLI
(`python -m sglang.launch_server`, its flags, its process), naming weightsync's custom weight
loader: weightsync attaches to it by URL (`SglEngineActor(url=...)`), syncs from a 2-rank FSDP2
trainer by buckets and then one-copy, verified, and the completions the server's own
OpenAI-compatible API answers equal the trainer's float32 reference. Attaching refuses a
missing or wrong key before anything is written; the server keeps running when the attached
actor goes. In-process too: a framework's own actor holding its own `sglang.Engine` with the
loader, reached through its dispatch method (`RayEndpoint(dispatch=)`)."""

from __future__ import annotations

import sys

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, check_sync_after_training, prompt_ids
from weightsync.apps.models import make_tiny_model, make_tokenizer
from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS, attach_flags
from weightsync.driver import launcher
from weightsync.engine.server import LocalServer, cli_flags, http_json

KEY = "attach-key-0815"
ACTOR = "weightsync.backends.sglang.engine.SglEngineActor"
NAME = "framework-sglang"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    command += ["--dtype", "float32", *cli_flags(CPU_ENGINE_ARGS), *attach_flags()]
    started = LocalServer([*command, f"--api-key={KEY}"], name="sglang", api_key=KEY)
    yield started, model
    started.shutdown()


@pytest.fixture(scope="module")
def attached(server):
    started, model = server
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        transport="shm",
    )
    trainer.call("connect", {NAME: engine})
    yield engine, trainer, started
    trainer.kill()
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _assert_server_serves_reference(started: LocalServer, trainer) -> None:
    """Greedy completions from the server's own /v1/completions equal the reference's text."""
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    tok = make_tokenizer()
    served = http_json("GET", started.base + "/v1/models", api_key=KEY)[1]["data"][0]["id"]
    for ids, tokens in zip(prompt_ids(), want["tokens"]):
        status, out = http_json(
            "POST",
            started.base + "/v1/completions",
            {
                "model": served,
                "prompt": ids,
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            api_key=KEY,
        )
        assert status == 200, out
        assert out["choices"][0]["text"] == tok.decode(tokens), (out, tokens)


def test_attached_server_syncs_verified_and_its_own_api_serves_the_trainers_weights(attached):
    engine, trainer, started = attached
    assert ray.get(engine.server_url.remote()) == started.base
    report = check_sync_after_training(engine, trainer, NAME, "attached-1", steps=2)
    assert report.engines[NAME].path == "buckets"
    _assert_server_serves_reference(started, trainer)

    # From the second sync on, shm on one host: the ranks write into the server's parameters.
    trainer.call("set_weights_from", 7)
    report = trainer.sync("attached-2", verify=True)
    assert report.engines[NAME].path == "one_copy", report
    assert report.verify is not None and report.verify[NAME].verified
    _assert_server_serves_reference(started, trainer)
    status, info = http_json("GET", started.base + "/model_info", api_key=KEY)
    assert status == 200 and info["weight_version"] == "attached-2", info


@pytest.mark.parametrize(
    "key, words",
    [
        (None, "demands an API key: pass api_key="),
        ("not-the-key", r"refused the API key given \(401\)"),
    ],
)
def test_attaching_without_the_servers_key_is_refused_at_launch(attached, key, words):
    _, _, started = attached
    with pytest.raises(Exception, match=words):
        engine = launcher.launch(ACTOR, url=started.base, api_key=key)
        ray.get(engine.server_url.remote(), timeout=120)


def test_an_attached_actor_leaves_the_server_running(attached, server):
    started, _ = server
    extra = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    ray.get(extra.shutdown.remote(), timeout=120)
    ray.kill(extra.handle)
    assert started.proc.poll() is None
    assert http_json("GET", started.base + "/health")[0] == 200


def test_a_server_that_answers_without_a_key_is_refused():
    """A server started without --api-key answers every route to anyone: attaching is refused;
    so is attaching to one without weightsync's loader."""
    from tests.engine_checks import open_json_server
    from weightsync.backends.sglang.engine import _Http
    from weightsync.backends.sglang.loader import LOADER

    info = {"custom_weight_loader": [LOADER], "tp_size": 1}
    with open_json_server({"/health": {}, "/server_info": info}) as url:
        with pytest.raises(PermissionError, match="answers /server_info without a key"):
            _Http.attach(url, api_key=KEY)
    info["custom_weight_loader"] = []
    with open_json_server({"/health": {}, "/server_info": info}, key=KEY) as url:
        with pytest.raises(ValueError, match="--custom-weight-loader"):
            _Http.attach(url, api_key=KEY)


def test_an_engine_made_without_weightsyncs_loader_is_refused_naming_the_argument():
    from types import SimpleNamespace

    from weightsync.backends.sglang.engine import SglEngineActor

    engine = SimpleNamespace(server_args=SimpleNamespace(custom_weight_loader=None, tp_size=1))
    with pytest.raises(ValueError, match=r"custom_weight_loader=\['weightsync.backends.sglang"):
        SglEngineActor(engine=engine)
    with pytest.raises(ValueError, match="engine= wraps an engine its owner made"):
        SglEngineActor("some/model", engine=engine)


def test_a_staged_trainer_refuses_a_server_without_weightsyncs_staged_route_at_connect(
    attached, server
):
    """SGLang's own update calls wait for every request in flight: a server started with
    `sglang.launch_server` cannot stage an update while it serves, and a trainer with
    `staged=True` is told so at connect, naming the module that serves the route."""
    engine, _, _ = attached
    _, model = server
    staged = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        staged=True,
    )
    try:
        with pytest.raises(Exception, match=r"no /weightsync/staged route"):
            staged.call("connect", {"plain": engine})
    finally:
        staged.kill()
