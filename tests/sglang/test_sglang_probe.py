"""The log-prob probe against loader faults planted in the real SGLang engine's own loaders.

A tiny OPT (SGLang on this CPU runs only models without rotary embeddings, at TP=1; q/k
sharpened as a trained model's attention is) in a framework's own in-process `sglang.Engine`
(tests/sglang/planted.py), synced from a 1-rank FSDP2 trainer with verification and the probe.
From the first sync, SGLang's loader of one layer-0 parameter is wrapped wrong: q and k swapped
inside qkv_proj, out_proj transposed, fc2 dropped. The probe fails the first two before commit
(fingerprints pass them: the placements are learned from the same loader); the dropped tensor's
parameter holds nothing the trainer sent, so verification fails it first, naming it. Each update
is rolled back (keep_previous), and the engine still serves the checkpoint's weights. Each fault
meets a receiver that has seen no sync, connected under the fault's name (tests/planted_faults.py). With SGLang's loaders
put back, the same trainer syncs, the probe passes (float32: a mean gap below 1e-3, decode steps
within 1e-2) and the engine's
greedy tokens equal the trainer's reference. OPT has no gate/up projection: that fault runs
on vLLM only (tests/vllm/test_vllm_probe.py)."""

from __future__ import annotations

import pytest
import ray

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids, training_batch
from tests.planted_faults import (
    check_caught,
    check_framework_actor,
    check_right,
    run_planted,
    sharp_checkpoint,
)
from tests.sglang.planted import KINDS
from weightsync.driver import launcher

ROLLOUT = "tests.sglang.planted.PlantedEngine"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = sharp_checkpoint("opt", str(tmp_path_factory.mktemp("opt-sharp")))
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "sglang")
    rollout = launcher.launch(ROLLOUT, path)
    yield rollout, path
    ray.get(rollout.shutdown.remote(), timeout=120)
    ray.shutdown()


def _trainer(path: str, **options):
    return launcher.TrainerGroup(
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
        model_path=path,
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        probe={"bound": 1e-3, "length": 24},
        **options,
    )


@pytest.fixture(scope="module")
def planted(engine):
    rollout, path = engine
    trainer = _trainer(path)
    yield run_planted(trainer, rollout, KINDS)
    trainer.kill()


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_fault_planted_from_the_first_sync_is_caught_before_commit(planted, kind):
    check_caught(planted, kind, engine="sglang", dropped_param="layers.0.fc2.weight")


def test_with_sglangs_loaders_back_the_probe_passes_and_tokens_equal_the_reference(planted):
    check_right(planted, decode_max=1e-2)  # SGLang-cpu's decode: 2.2e-3 from the trainer


def test_the_framework_actor_refuses_its_own_generation_mid_update_and_takes_the_one_copy_path(
    planted,
):
    check_framework_actor(planted)


def test_a_staged_sync_is_probed_after_its_switch_and_one_that_fails_is_switched_back(engine):
    """Staged syncs with the probe into the engine, which keeps its previous weights (a
    switch swaps). With layer 0's q and k swapped by SGLang's own loader (fingerprints pass
    it), the staged sync loads and verifies its copy while the engine serves, switches, and
    its probe, scored on the weights just switched in with generation held, fails it: the
    engine is switched back before it answers again and serves the previous version whole
    (its tag and greedy tokens). With SGLang's loaders back, the next staged sync's probe
    passes and the engine serves the trainer's reference tokens."""
    rollout, path = engine
    trainer = _trainer(path, staged=True, verify=True, keep_previous=True)

    def connect(name: str) -> None:
        trainer.call("connect", {name: {"actor": rollout, "dispatch": "weightsync"}})

    def tokens() -> list[list[int]]:
        return ray.get(rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)

    def version() -> str | None:
        return ray.get(rollout.weightsync.remote("weight_version"), timeout=120)

    try:
        ray.get(rollout.plant.remote("qk_swapped"), timeout=120)
        try:
            connect("sp-fault")
            trainer.call("train_step", training_batch(9))
            before, served = version(), tokens()
            with pytest.raises(Exception, match="failed the log-prob probe") as caught:
                trainer.sync("sp-1", engines=["sp-fault"])
            assert "probed after its switch: it serves" in str(caught.value), str(caught.value)[
                :2000
            ]
            assert version() == before and tokens() == served
        finally:
            ray.get(rollout.unplant.remote(), timeout=120)
        connect("sp")  # a fresh receiver (loaders are learned on first sight)
        report = trainer.sync("sp-2", engines=["sp"])
        synced = report.engines["sp"]
        assert report.verify["sp"].verified and synced.pause_s > 0, synced
        assert synced.probe_gap is not None and synced.probe_gap < 1e-3, synced
        print(f"staged probe: mean {synced.probe_gap:.2e}, probe {synced.probe_s:.3f} s")
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert version() == "sp-2" and tokens() == want["tokens"]
    finally:
        trainer.kill()


@pytest.fixture(scope="module")
def replica(engine):
    """A second in-process engine of the same model, keeping its previous weights."""
    _, path = engine
    one = launcher.launch(
        "weightsync.backends.sglang.engine.SglEngineActor", path, mode="engine", keep_previous=True
    )
    yield one
    ray.get(one.shutdown.remote(), timeout=120)


def test_a_staged_sync_whose_probe_fails_on_one_engine_is_switched_back_on_the_other(
    engine, replica
):
    """All or none across two SGLang engines: a staged, verified and probed sync with
    `keep_previous` into the framework's engine (layer 0's q and k swapped by SGLang's own
    loader: its probe fails after its switch, and it switches itself back) and a replica (its
    probe passes, serving the weights it started with until then). The replica is switched
    back before the sync raises: both serve what they served before (tags and greedy tokens),
    and the error names what each serves. With SGLang's loaders back, the next sync serves the
    trainer's reference tokens on both."""
    rollout, path = engine
    trainer = _trainer(path, staged=True, verify=True, keep_previous=True)

    def served() -> dict[str, tuple]:
        fault = ray.get(rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)
        other = ray.get(
            replica.generate.remote(prompt_ids(), max_new_tokens=MAX_NEW_TOKENS), timeout=300
        )
        return {
            "fault": (ray.get(rollout.weightsync.remote("weight_version"), timeout=120), fault),
            "replica": (ray.get(replica.weight_version.remote(), timeout=120), other["tokens"]),
        }

    try:
        before = served()
        ray.get(rollout.plant.remote("qk_swapped"), timeout=120)
        try:
            trainer.call(
                "connect",
                {"aon-fault": {"actor": rollout, "dispatch": "weightsync"}, "aon-r": replica},
            )
            trainer.call("train_step", training_batch(10))
            with pytest.raises(Exception, match="all or none") as caught:
                trainer.sync("aon-1")
        finally:
            ray.get(rollout.unplant.remote(), timeout=120)
        message = str(caught.value)
        assert "1 of 2 engine(s) failed at the switch (['aon-fault'])" in message, message[:3000]
        assert "'aon-r': \"switched back to 'its start-up weights'\"" in message, message[:3000]
        assert "failed the log-prob probe" in message
        assert served() == before
        # A fresh receiver for the framework's engine (loaders are learned on first sight).
        trainer.call("connect", {"aon-ok": {"actor": rollout, "dispatch": "weightsync"}})
        report = trainer.sync("aon-2", engines=["aon-ok", "aon-r"])
        assert all(report.verify[n].verified for n in ("aon-ok", "aon-r")), report.verify
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert served() == {n: ("aon-2", want["tokens"]) for n in ("fault", "replica")}
    finally:
        trainer.kill()
