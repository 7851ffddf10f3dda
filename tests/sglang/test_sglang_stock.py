"""A stock SGLang server (`python -m sglang.launch_server`, nothing of weightsync's on its command
line or in its process: no custom weight loader), serving OPT in float32 with an API key.
weightsync syncs it through SGLang's own reload (`SglStockEngine(url=...)`: buckets staged into a
checkpoint in /dev/shm, then /update_weights_from_disk with the version and a cache flush) from a
2-rank FSDP2 trainer; the completions the server's own OpenAI-compatible API answers then equal
the trainer's float32 reference, for prompts it had cached before the sync too. Verification is
refused, naming why, before anything is written."""

from __future__ import annotations

import sys

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids, training_batch
from weightsync.apps.models import make_tiny_model, make_tokenizer
from weightsync.backends.sglang.engine import CPU_ENGINE_ARGS
from weightsync.driver import launcher
from weightsync.engine.server import LocalServer, cli_flags, http_json

KEY = "stock-key-1618"
ACTOR = "weightsync.backends.sglang.stock.SglStockEngine"
NAME = "stock-sglang"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    command += ["--dtype", "float32", *cli_flags(CPU_ENGINE_ARGS), f"--api-key={KEY}"]
    started = LocalServer(command, name="sglang", api_key=KEY)
    yield started, model
    started.shutdown()


@pytest.fixture(scope="module")
def stock(server):
    started, model = server
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(ACTOR, url=started.base, api_key=KEY)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
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


def _server_texts(started: LocalServer) -> list[str]:
    """Greedy completions from the server's own /v1/completions."""
    served = http_json("GET", started.base + "/v1/models", api_key=KEY)[1]["data"][0]["id"]
    texts = []
    for ids in prompt_ids():
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
        texts.append(out["choices"][0]["text"])
    return texts


def _assert_server_serves_reference(started: LocalServer, trainer) -> None:
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    tok = make_tokenizer()
    assert _server_texts(started) == [tok.decode(tokens) for tokens in want["tokens"]]


def test_a_stock_server_is_synced_by_its_own_reload_and_serves_the_trainers_weights(stock):
    engine, trainer, started, answers = stock
    assert "its weights cannot be read back" in answers[NAME]["unverifiable"]
    _server_texts(started)  # these prompts' prefixes are now in its cache
    for step in range(2):
        trainer.call("train_step", training_batch(step))
    with pytest.raises(Exception, match="sync.verify=True. refused, nothing was written"):
        trainer.sync("stock-0", verify=True)
    assert ray.get(engine.weight_version.remote()) is None
    report = trainer.sync("stock-1")
    assert report.engines[NAME].path == "buckets" and report.verify is None
    assert report.engines[NAME].weight_version == "stock-1"
    _assert_server_serves_reference(started, trainer)
    status, info = http_json("GET", started.base + "/model_info", api_key=KEY)
    assert status == 200 and info["weight_version"] == "stock-1", info

    trainer.call("set_weights_from", 11)  # very different weights, the same staged file
    report = trainer.sync("stock-2")
    assert report.engines[NAME].weight_version == "stock-2"
    _assert_server_serves_reference(started, trainer)


@pytest.mark.parametrize(
    "key, words",
    [(None, "refused a request without an API key"), ("wrong", "refused the API key given")],
)
def test_attaching_without_the_servers_key_is_refused_at_launch(stock, key, words):
    started = stock[2]
    with pytest.raises(Exception, match=words):
        engine = launcher.launch(ACTOR, url=started.base, api_key=key)
        ray.get(engine.staged_folder.remote(), timeout=120)
