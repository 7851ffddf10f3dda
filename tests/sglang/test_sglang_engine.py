"""A real SGLang engine (in-process sglang.Engine, tiny OPT) kept in step with a 2-rank FSDP2
trainer over gloo, through shared-memory buckets; a second replica joins the same trainer."""

from __future__ import annotations

import json
import math
import os
from importlib import metadata

import pytest
import ray
import torch

from tests.engine_checks import (
    MAX_NEW_TOKENS,
    assert_engine_matches_reference,
    check_failed_verification_is_never_adopted,
    check_repeated_syncs,
    check_sync_after_training,
    prompt_ids,
    training_batch,
)
from weightsync.apps.models import make_tiny_model, make_tokenizer
from weightsync.driver import launcher
from weightsync.engine.refit import checkpoint_specs

ARCH = "opt"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("model")), arch=ARCH, seed=0)


@pytest.fixture(scope="module")
def setup(model):
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch(
        "weightsync.backends.sglang.engine.SglEngineActor", model, mode="engine"
    )
    trainer = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
    )
    trainer.call("connect", {"sglang": engine})
    # A second replica, started once the first is up, connected to the same trainer later.
    replica = launcher.launch(
        "weightsync.backends.sglang.engine.SglEngineActor", model, mode="engine"
    )
    trainer.call("connect", {"sglang-2": replica})
    yield engine, trainer, replica
    for e in (engine, replica):
        ray.get(e.shutdown.remote(), timeout=120)
    ray.shutdown()


def test_the_trainer_ranks_run_in_the_sglang_env_beside_its_torch(setup):
    _, trainer, _ = setup
    assert trainer.call("engine_versions") == {
        "env": "sglang",
        "sglang": metadata.version("sglang"),
        "torch": str(torch.__version__),
    }


def test_sync_after_training_is_verified_and_generation_matches_reference(setup):
    engine, trainer, _ = setup
    report = check_sync_after_training(engine, trainer, "sglang", "step-3", steps=3)
    assert report.engines["sglang"].weight_version == "step-3"
    assert ray.get(engine.engine_weight_version.remote()) == "step-3"  # SGLang's own tag


def test_one_sync_serves_two_replicas_each_verified(setup):
    engine, trainer, replica = setup
    report = trainer.call("sync", "both", verify=True)
    for name, e in (("sglang", engine), ("sglang-2", replica)):
        assert report["verify"][name]["verified"], report["verify"]
        assert report["engines"][name]["weight_version"] == "both"
        assert ray.get(e.weight_version.remote()) == "both"
        assert_engine_matches_reference(e, trainer)


def test_repeated_syncs_with_requests_in_between(setup):
    engine, trainer, _ = setup
    # The first sync went by buckets; the engine then shared its parameters.
    check_repeated_syncs(engine, trainer, "sglang", "round", rounds=3, path="one_copy")


def test_shape_mismatch_is_rejected_before_any_engine_weight_changes(setup):
    engine, trainer, _ = setup
    trainer.call("sync", "good", verify=True)
    prints = ray.get(engine.fingerprints.remote())
    specs = trainer.call("refit_info")
    bad = [dict(s) for s in specs]
    victim = next(s for s in bad if s["name"].endswith("fc1.weight"))
    victim["shape"] = list(reversed(victim["shape"]))
    with pytest.raises(ValueError, match=r"fc1.weight.*trainer shape \(256, 1024\)"):
        ray.get(engine.check_refit.remote(bad))
    unknown = [dict(s) for s in specs] + [
        {"name": "model.decoder.layers.9.fc9.weight", "dtype": "float32", "shape": [4, 4]}
    ]
    with pytest.raises(ValueError, match=r"no parameter for 1 trainer tensor.*layers.9.fc9"):
        ray.get(engine.check_refit.remote(unknown))
    wrong_dtype = [dict(s, dtype="bfloat16") for s in specs]
    with pytest.raises(ValueError, match="trainer dtype bfloat16 != engine dtype float32"):
        ray.get(engine.check_refit.remote(wrong_dtype))
    assert ray.get(engine.fingerprints.remote()) == prints
    assert ray.get(engine.weight_version.remote()) == "good"
    # The engine still serves, with its previous weights and version.
    assert ray.get(engine.generate.remote(prompt_ids()))["weight_version"] == "good"
    trainer.call("connect", {})  # no-op: the registered engine stays usable
    assert trainer.call("sync", "after-bad", verify=True)["verify"]["sglang"]["verified"]


def test_sampling_returns_n_samples_per_prompt_and_bad_options_are_refused(setup):
    engine = setup[0]
    out = ray.get(
        engine.generate.remote(
            [[5, 6, 7], [8, 9]],
            temperature=1.0,
            top_p=0.9,
            n=3,
            seed=7,
            max_new_tokens=5,
            ignore_eos=True,
        )
    )
    assert [len(t) for t in out["tokens"]] == [5] * 6
    assert all(len(lp) == 5 and max(lp) <= 0 for lp in out["logprobs"])
    for bad, named in (
        ({"temperature": -1.0}, r"temperature=-1\.0"),
        ({"n": 0}, "n=0"),
        ({"top_p": 1.5}, r"top_p=1\.5"),
        ({"top_p": 0.0}, r"top_p=0\.0"),
    ):
        with pytest.raises(ValueError, match=named):
            ray.get(engine.generate.remote([[5, 6]], **bad))


def test_a_sync_that_fails_verification_is_never_adopted(setup):
    engine, trainer, _ = setup
    check_failed_verification_is_never_adopted(engine, trainer, "sglang")
    report = trainer.call("sync", "after-failed-verification", verify=True)
    assert report["verify"]["sglang"]["verified"]
    assert_engine_matches_reference(engine, trainer)


def _staged_trainer(model: str, **options):
    """A trainer that syncs staged and verified into several engines, switching them at one
    named instant (`switch_lead_s`), and `options`."""
    return launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 16,
        seed=0,
        staged=True,
        verify=True,
        switch_lead_s=0.05,
        **options,
    )


def test_staged_syncs_into_both_replicas_are_verified_and_serve_the_trainers_weights(setup, model):
    """A trainer with `staged=True`: each sync loads into a second copy of both in-process
    engines' parameters while they serve, verifies each against its copy, then switches both
    at the one instant the trainer named (`switch_lead_s`: each serves on until it); each
    reports its pause, the instant and when it switched. A non-staged sync after them, and a
    staged one after that, still land (the copy is made again); that last one is not verified:
    each scheduler readies its switch at `end` (the staged `prepare` op), not at `stage`."""
    engine, trainer, replica = setup
    engines = {"sglang": engine, "sglang-2": replica}
    staged = _staged_trainer(model)
    try:
        staged.call("connect", engines)
        for i in range(2):
            staged.call("set_weights_from", 3000 + i)
            report = staged.call("sync", f"staged-{i}", verify=i == 0)
            parts = report["engines"]
            print(
                f"staged-{i}: sync {report['sync_s']:.3f} s, pauses "
                f"{ {n: round(p['pause_s'] * 1e3, 1) for n, p in parts.items()} } ms, switches "
                f"{abs(parts['sglang']['switched_at'] - parts['sglang-2']['switched_at']) * 1e3:.1f}"
                f" ms apart"
            )
            assert parts["sglang"]["switch_at"] == parts["sglang-2"]["switch_at"]
            checked = report.get("verify")
            assert bool(checked) == (i == 0), checked
            for name, one in engines.items():
                assert i or checked[name]["verified"], checked
                assert parts[name]["path"] == "buckets" and parts[name]["pause_s"] > 0
                assert parts[name]["switched_at"] >= parts[name]["switch_at"]
                assert ray.get(one.engine_weight_version.remote()) == f"staged-{i}"
                assert_engine_matches_reference(one, staged)
            if i == 0:  # the served weights written otherwise: the next staged copy is remade
                trainer.call("train_step", training_batch(40))
                trainer.call("sync", "between", verify=True)
    finally:
        staged.kill()


def test_a_staged_sync_that_fails_verification_is_adopted_by_neither_replica(setup):
    """A staged, verified sync into both in-process engines whose check fails (planted on the
    sender's side: both hold the new bytes in their staged copies when checked) is aborted
    before either switches: both keep their version, fingerprints and answers."""
    engine, trainer, replica = setup
    check_failed_verification_is_never_adopted(
        engine, trainer, "sglang", staged=True, replicas={"sglang-2": replica}
    )


def test_a_staged_sync_that_kept_the_previous_weights_is_reverted_on_both_replicas(setup, model):
    """`SyncOptions(staged=True, keep_previous=True)`: each switch swaps the served weights
    with the staged copy, so `TrainerSync.revert` asks both in-process engines at once to serve
    the previous version again, each in one short pause: its version tag, its fingerprints and
    its greedy tokens. Nothing is left to revert after a revert; the next staged sync is
    verified (its copy made again from the reverted weights). Released on request
    (`release_staged`), each copy's bytes are freed and the last switch can no longer be
    reverted; the next staged sync makes them again. A sync that is not staged frees them at
    its begin (staged syncs stopped)."""
    engine, trainer, replica = setup
    engines = {"sglang": engine, "sglang-2": replica}
    staged = _staged_trainer(model, keep_previous=True)

    def served(one) -> list[list[int]]:
        return ray.get(one.generate.remote(prompt_ids(), max_new_tokens=MAX_NEW_TOKENS))["tokens"]

    try:
        staged.call("connect", engines)
        firsts = {}
        for i in range(2):
            staged.call("set_weights_from", 3100 + i)
            report = staged.sync(f"rev-{i}")
            assert all(report.verify[n].verified for n in engines), report.verify
            firsts[i] = {n: served(one) for n, one in engines.items()}
            prints = {n: ray.get(one.fingerprints.remote()) for n, one in engines.items()}
            if i == 0:
                kept = prints
        assert firsts[0] != firsts[1], "two versions alike: nothing shown"
        reverted = staged.call("revert")
        print(
            f"revert: pauses { {n: round(r['pause_s'] * 1e3, 1) for n, r in reverted.items()} } "
            f"ms, {abs(reverted['sglang']['switched_at'] - reverted['sglang-2']['switched_at']) * 1e3:.1f}"
            f" ms apart"
        )
        assert reverted["sglang"]["switch_at"] == reverted["sglang-2"]["switch_at"]
        for name, one in engines.items():
            assert reverted[name]["weight_version"] == "rev-0" and reverted[name]["pause_s"] > 0
            assert reverted[name]["switched_at"] >= reverted[name]["switch_at"]
            assert ray.get(one.engine_weight_version.remote()) == "rev-0"
            assert ray.get(one.fingerprints.remote()) == kept[name]
            assert served(one) == firsts[0][name]
        assert prints != kept  # the second version's differed: the revert changed something
        with pytest.raises(Exception, match="nothing to revert"):
            staged.call("revert")
        staged.call("set_weights_from", 3102)
        report = staged.sync("rev-2")
        assert all(report.verify[n].verified for n in engines), report.verify
        for one in engines.values():
            assert_engine_matches_reference(one, staged)

        # Each staged copy released on request: its bytes freed (one copy of every parameter,
        # the same model in both), the switch before can no longer be reverted, and the next
        # staged sync makes the copies again.
        released = [
            ray.get(one.release_staged.remote())["released_bytes"] for one in engines.values()
        ]
        print(f"released: {released}")
        assert released[0] == released[1] > 0
        with pytest.raises(Exception, match="nothing to revert"):
            staged.call("revert")
        assert [ray.get(one.release_staged.remote()) for one in engines.values()] == [
            {"released_bytes": 0}
        ] * 2
        staged.call("set_weights_from", 3103)
        report = staged.sync("rev-3")
        assert all(report.verify[n].verified for n in engines), report.verify
        for one in engines.values():
            assert_engine_matches_reference(one, staged)

        # Staged syncs stop: the next sync, not staged, frees each engine's copy at its begin
        # (it writes the served weights, so the copy would be made again whole anyway).
        report = trainer.call("sync", "unstaged", verify=True)
        assert all(report["verify"][n]["verified"] for n in engines), report["verify"]
        assert [ray.get(one.release_staged.remote()) for one in engines.values()] == [
            {"released_bytes": 0}
        ] * 2
    finally:
        staged.kill()
        for one in engines.values():  # later tests update without keeping the previous weights
            ray.get(one.set_keep_previous.remote(False), timeout=120)


def test_a_trainer_that_syncs_point_to_point_refuses_sglang_at_connect(setup, tmp_path):
    """SGLang has no point-to-point receiver (docs/scale.md): a trainer with
    `point_to_point=True` refuses it at connect, naming it, before anything is written."""
    engine, trainer, _ = setup
    version = ray.get(engine.weight_version.remote())
    other = launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        world_size=1,
        model_path=make_tiny_model(str(tmp_path / "model"), arch=ARCH, seed=0),
        bucket_bytes=1 << 20,
        seed=1,
        point_to_point=True,
    )
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            other.call("connect", {"sglang": engine})
        message = str(info.value)
        assert "engine 'sglang' cannot take the point-to-point path" in message, message
        assert "SglEngineActor has no point-to-point receiver" in message, message
        assert ray.get(engine.weight_version.remote()) == version
    finally:
        other.call("shutdown")
        other.kill()


EOS_PROMPT = 2  # of prompt_ids(): the third engine's model ends after its first token


def make_model_ending_at_its_first_greedy_token(path: str, prompt: list[int]) -> int:
    """A bfloat16 tiny OPT at `path` whose config.json and generation_config.json name as its
    end-of-sequence token the one it greedily produces first after `prompt`; that token."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(path, arch="opt", seed=0, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        eos = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name)) as f:
            config = json.load(f)
        with open(os.path.join(path, name), "w") as f:
            json.dump({**config, "eos_token_id": eos}, f)
    return eos


@pytest.fixture(scope="module")
def eos_engine(setup, tmp_path_factory):
    """(engine, model path, EOS token id): never synced, started with no dtype or length."""
    path = str(tmp_path_factory.mktemp("eos-model"))
    eos = make_model_ending_at_its_first_greedy_token(path, prompt_ids()[EOS_PROMPT])
    engine = launcher.launch("weightsync.backends.sglang.engine.SglEngineActor", path)
    yield engine, path, eos
    ray.get(engine.shutdown.remote(), timeout=120)


def test_a_greedy_sample_ends_at_the_models_end_of_sequence_unless_told_to_go_on(eos_engine):
    engine, _, eos = eos_engine
    prompt = [prompt_ids()[EOS_PROMPT]]
    out = ray.get(engine.generate.remote(prompt, max_new_tokens=8))
    assert out["tokens"] == [[eos]] and out["finish_reasons"] == ["stop"]
    assert len(out["logprobs"][0]) == 1
    on = ray.get(engine.generate.remote(prompt, max_new_tokens=8, ignore_eos=True))
    assert len(on["tokens"][0]) == 8 and on["tokens"][0][0] == eos
    assert on["finish_reasons"] == ["length"]


def test_min_new_tokens_hold_the_end_of_sequence_off(eos_engine):
    engine, _, eos = eos_engine
    prompt = [prompt_ids()[EOS_PROMPT]]
    tokens = ray.get(engine.generate.remote(prompt, max_new_tokens=8, min_new_tokens=3))["tokens"]
    assert len(tokens[0]) >= 3 and eos not in tokens[0][:3], (tokens, eos)


def test_stop_token_ids_and_stop_strings_end_a_sample_at_the_token_that_matched(eos_engine):
    engine, _, eos = eos_engine
    prompt = [prompt_ids()[1]]
    free = ray.get(engine.generate.remote(prompt, max_new_tokens=8, ignore_eos=True))["tokens"][0]
    natural = free[: free.index(eos) + 1] if eos in free else free
    assert len(natural) >= 2, (free, eos)  # this prompt does not end at once
    stopped = ray.get(engine.generate.remote(prompt, max_new_tokens=8, stop_token_ids=[free[0]]))
    assert stopped["tokens"] == [free[:1]] and stopped["finish_reasons"] == ["stop"]
    chars = [make_tokenizer().decode([t]) for t in free]
    stop = chars[-1]
    assert stop.isascii() and stop.isprintable(), chars
    out = ray.get(engine.generate.remote(prompt, max_new_tokens=8, ignore_eos=True, stop=[stop]))
    assert out["tokens"] == [free[: chars.index(stop) + 1]] and out["finish_reasons"] == ["stop"]


def test_top_logprobs_list_the_most_likely_tokens_first(eos_engine):
    engine = eos_engine[0]
    out = ray.get(
        engine.generate.remote([prompt_ids()[1]], max_new_tokens=4, ignore_eos=True, top_logprobs=3)
    )
    (top,) = out["top_logprobs"]
    assert [len(step) for step in top] == [3] * 4
    for step, token, logprob in zip(top, out["tokens"][0], out["logprobs"][0], strict=True):
        assert step[0][0] == token and math.isclose(step[0][1], logprob, abs_tol=1e-6)
        assert step[0][1] >= step[1][1] >= step[2][1]
    assert "top_logprobs" not in ray.get(engine.generate.remote([prompt_ids()[1]]))


def test_the_engine_takes_its_dtype_and_context_length_from_the_models_config(eos_engine):
    engine, path, _ = eos_engine
    specs = [s.to_dict() for s in checkpoint_specs(path).values()]
    assert {s["dtype"] for s in specs} == {"bfloat16"}
    assert ray.get(engine.check_refit.remote(specs))["num_receivers"] == 1
    with pytest.raises(ValueError, match="trainer dtype float32 != engine dtype bfloat16"):
        ray.get(engine.check_refit.remote([dict(s, dtype="float32") for s in specs]))
    # max_position_embeddings is 512: a 400-token prompt is served, a 600-token one is not.
    long = [3 + i % 250 for i in range(400)]
    out = ray.get(engine.generate.remote([long], max_new_tokens=8, ignore_eos=True))
    assert len(out["tokens"][0]) == 8
    with pytest.raises(ValueError, match=r"model's context length \(512 tokens\)"):
        ray.get(engine.generate.remote([long + long[:200]], max_new_tokens=8))
