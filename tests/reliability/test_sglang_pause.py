"""SGLang's HTTP server paused while parameters are written: clients that call the server
directly never get an answer decoded on half-written weights or on two versions."""

from __future__ import annotations

import time

import pytest
import ray

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

NAME = "sglang-http"
NUM_SYNCS = 50


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.sglang.engine.SglEngineActor", model,
                             mode="http")
    trainer = launcher.TrainerGroup("weightsync.backends.sglang.worker."
                                    "SglDTensorV2WeightSyncWorker",
                                    model_path=model, bucket_bytes=1 << 20, seed=0)
    trainer.call("connect", {NAME: engine})
    yield engine, trainer
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.shutdown()


def _hammer(engine) -> Hammer:
    base, key = engine_server(engine)

    def ask(prompt: list[int]):
        return post_json(base, "/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS,
                                "ignore_eos": True}}, api_key=key)

    def parse(out):
        meta = out["meta_info"]
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None, meta.get("weight_version")
        return [int(p[1]) for p in meta["output_token_logprobs"]], meta.get("weight_version")

    return Hammer(ask, parse)


def test_direct_http_clients_never_see_half_written_weights_during_many_syncs(setup):
    """The first sync goes by buckets, then the engine's parameters are shared (the probe
    writes random bytes into them) and every later sync writes them in place."""
    engine, trainer = setup
    start = time.monotonic()
    hammer = _hammer(engine)
    run = run_syncs_under_requests(trainer, NAME, hammer, num_syncs=NUM_SYNCS)
    assert run["paths"][0] == "buckets" and set(run["paths"][1:]) == {"direct"}, run["paths"]
    # SGLang tags each answer with its weight version: "default" before the first sync.
    counts = check_answers(hammer, run["refs"], run["windows"],
                           tag_of=lambda v: f"v{v}" if v else "default")
    print(f"{NUM_SYNCS} syncs, {counts}, {time.monotonic() - start:.0f} s")
