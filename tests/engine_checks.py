"""Checks shared by the engine suites: what "the engine serves the trainer's weights" means."""

from __future__ import annotations

import math

import ray

from weightsync.models import make_tokenizer

PROMPTS = ["The quick brown fox", "weightsync keeps engines", "Once upon a time"]
MAX_NEW_TOKENS = 8


def prompt_ids() -> list[list[int]]:
    tok = make_tokenizer()
    return [tok(p).input_ids for p in PROMPTS]


def assert_engine_matches_reference(engine, trainer, *, logprob_tol: float = 1e-3) -> None:
    """Greedy tokens equal the trainer's float32 transformers reference; logprobs close."""
    ids = prompt_ids()
    want = trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)
    got = ray.get(engine.generate.remote(ids, max_new_tokens=MAX_NEW_TOKENS), timeout=300)
    assert got["tokens"] == want["tokens"]
    for g_row, w_row in zip(got["logprobs"], want["logprobs"]):
        for g, w in zip(g_row, w_row):
            assert math.isclose(g, w, abs_tol=logprob_tol), (g_row, w_row)


def training_batch(step: int) -> list[list[int]]:
    tok = make_tokenizer()
    text = f"step {step}: the engines follow the trainer, bucket by bucket."
    return [tok(text).input_ids[:48]] * 2
