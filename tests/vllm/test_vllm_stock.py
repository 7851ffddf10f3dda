"""A stock vLLM server (vLLM's own CLI, nothing of weightsync's on its command line or in its
process: no worker extension, no guard), serving a Qwen2-shaped model (rope, grouped-query
attention, untied head) in float32, with VLLM_SERVER_DEV_MODE=1 and an API key. weightsync
syncs it through vLLM's own reload (`VllmStockEngine(url=...)`: buckets staged into a
checkpoint in /dev/shm, then /pause, /collective_rpc reload_weights, /reset_prefix_cache,
/update_weight_version, /resume) from a 2-rank FSDP2 trainer; the completions the server's own
OpenAI-compatible API answers then equal the trainer's float32 reference, for prompts it had
cached before the sync too. Verification is refused, naming why, before anything is written."""

from __future__ import annotations

import math
import sys

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids, training_batch
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher
from weightsync.engine.server import LocalServer, http_json

KEY = "stock-key-2718"
ACTOR = "weightsync.backends.vllm.stock.VllmStockEngine"
NAME = "stock-vllm"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="qwen2", seed=0)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--dtype", "float32", "--enforce-eager", "--api-key", KEY]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    started = LocalServer(command, name="vllm", api_key=KEY, env=env)
    yield started, model
    started.shutdown()


@pytest.fixture(scope="module")
def stock(server):
    started, model = server
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        verify=False,  # a stock engine cannot be verified
    )
    answers = trainer.call("connect", {NAME: engine})
    yield engine, trainer, started, answers
    trainer.kill()
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _server_completions(started: LocalServer) -> dict:
    """Greedy completions from the server's own /v1/completions (token ids in and out)."""
    served = http_json("GET", started.base + "/v1/models", api_key=KEY)[1]["data"][0]["id"]
    status, out = http_json(
        "POST",
        started.base + "/v1/completions",
        {
            "model": served,
            "prompt": prompt_ids(),
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
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


def _assert_server_serves_reference(started: LocalServer, trainer) -> None:
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    got = _server_completions(started)
    assert got["tokens"] == want["tokens"]
    for g_row, w_row in zip(got["logprobs"], want["logprobs"]):
        assert all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(g_row, w_row)), (g_row, w_row)


def test_a_stock_server_is_synced_by_its_own_reload_and_serves_the_trainers_weights(stock):
    engine, trainer, started, answers = stock
    assert "its weights cannot be read back" in answers[NAME]["unverifiable"]
    before = _server_completions(started)  # these prompts' prefixes are now in its cache
    for step in range(2):
        trainer.call("train_step", training_batch(step))
    with pytest.raises(Exception, match="sync.verify=True. refused, nothing was written"):
        trainer.sync("stock-0", verify=True)
    assert ray.get(engine.weight_version.remote()) is None
    report = trainer.sync("stock-1")
    assert report.engines[NAME].path == "buckets" and report.verify is None
    assert report.engines[NAME].weight_version == "stock-1"
    assert report.engines[NAME].cache_flushed
    assert _server_completions(started) != before
    _assert_server_serves_reference(started, trainer)
    status, info = http_json("GET", started.base + "/weight_info", api_key=KEY)
    assert status == 200 and "stock-1" in str(info), info

    trainer.call("set_weights_from", 11)  # very different weights, the same staged file
    report = trainer.sync("stock-2")
    assert report.engines[NAME].weight_version == "stock-2"
    _assert_server_serves_reference(started, trainer)


def test_a_trainer_that_verifies_every_sync_is_refused_at_connect(stock, server):
    started, model = server
    strict = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        seed=0,
        verify=True,
        world_size=1,
    )
    extra = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    try:
        with pytest.raises(Exception, match="cannot be verified and this trainer verifies every"):
            strict.call("connect", {"extra": extra})
    finally:
        strict.kill()
        ray.get(extra.shutdown.remote(), timeout=120)


@pytest.mark.parametrize(
    "key, words",
    [(None, "refused a request without an API key"), ("wrong", "refused the API key given")],
)
def test_attaching_without_the_servers_key_is_refused_at_launch(stock, key, words):
    started = stock[2]
    with pytest.raises(Exception, match=words):
        engine = launcher.launch(ACTOR, url=started.base, api_key=key)
        ray.get(engine.staged_folder.remote(), timeout=120)
