"""A real SGLang engine (in-process sglang.Engine, tiny OPT) kept in step with a 2-rank FSDP2
trainer over gloo, through shared-memory buckets; a second replica joins the same trainer."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import (
    assert_engine_matches_reference,
    check_failed_verification_is_never_adopted,
    check_repeated_syncs,
    check_sync_after_training,
    prompt_ids,
)
from weightsync.apps.models import make_tiny_model
from weightsync.launch import launcher

ARCH = "opt"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("model")), arch=ARCH, seed=0)
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


def test_sync_after_training_is_verified_and_generation_matches_reference(setup):
    engine, trainer, _ = setup
    report = check_sync_after_training(engine, trainer, "sglang", "step-3", steps=3)
    assert report["engines"]["sglang"]["weight_version"] == "step-3"
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
            [[5, 6, 7], [8, 9]], temperature=1.0, top_p=0.9, n=3, seed=7, max_new_tokens=5
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
