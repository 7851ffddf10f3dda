"""Engine topologies: a tensor-parallel vLLM engine (TP=2: two worker processes, each holding
slices of every tensor) and a second replica (TP=1), kept in step by one 2-rank FSDP2 trainer
in one sync, each worker verified against what it holds. The model is a tiny Qwen2 (rope, GQA
4/2 heads, untied head)."""

from __future__ import annotations

import time

import pytest
import ray

from tests.engine_checks import (
    assert_engine_matches_reference,
    check_failed_verification_is_never_adopted,
    half_update,
    prompt_ids,
    training_batch,
)
from weightsync.apps.models import make_tiny_model
from weightsync.driver import launcher

ENGINE = "weightsync.backends.vllm.engine.VllmEngineActor"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", seed=0)
    launcher.init_ray(num_cpus=2)
    # The TP engine keeps its previous weights during an update, to put them back on failure.
    tp2 = launcher.launch(ENGINE, model, tensor_parallel_size=2, keep_previous=True)
    tp1 = launcher.launch(ENGINE, model)
    # Each trainer rank in a bundle of its own (on a GPU cluster: {"GPU": 1}).
    ranks = launcher.place(2, {"CPU": 0.5})
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        placements=ranks,
    )
    assert [ray.get(r.handle.where.remote())["placement_group"] for r in trainer.ranks] == [
        ranks[0].group.id.hex()
    ] * 2
    answer = trainer.call("connect", {"tp2": tp2, "tp1": tp1})
    yield {"tp2": tp2, "tp1": tp1}, trainer, model, answer
    ray.shutdown()


def test_connect_counts_every_worker_process(setup):
    *_, answer = setup
    assert answer["tp2"]["num_receivers"] == 2
    assert answer["tp1"]["num_receivers"] == 1


def test_an_update_before_the_engine_learned_where_tensors_land_is_rolled_back(setup):
    """tp2 has loaded no tensor yet, so it cannot know which parameters a tensor lands in (q_proj
    lands inside the fused qkv_proj): with keep_previous it copies every parameter before the
    load, and an update aborted after it is undone in both workers."""
    engines, trainer, *_ = setup
    tp2 = engines["tp2"]
    version = ray.get(tp2.weight_version.remote())
    # No fingerprints to compare: an engine reports those of parameters it knows a tensor
    # lands in, and it knows none yet. The answers show the weights: random values half
    # loaded into q_proj would change every logprob.
    served = ray.get(tp2.generate.remote(prompt_ids()))
    half_update(
        tp2,
        next(
            s
            for s in trainer.call("refit_info")
            if s["name"].endswith("layers.1.self_attn.q_proj.weight")
        ),
    )
    assert ray.get(tp2.weight_version.remote()) == version
    ray.get(tp2.settle.remote(), timeout=300)  # GEMMs re-packed from the restored weights
    got = ray.get(tp2.generate.remote(prompt_ids()))
    assert got["tokens"] == served["tokens"]
    for g_row, s_row in zip(got["logprobs"], served["logprobs"]):
        assert g_row == pytest.approx(s_row, abs=1e-4)


def test_one_sync_serves_both_replicas_each_tp_worker_verified(setup):
    engines, trainer, *_ = setup
    for step in range(2):
        trainer.call("train_step", training_batch(step))
    report = trainer.call("sync", "step-2", verify=True)
    checked = report["verify"]
    assert checked["tp2"]["verified"] and checked["tp1"]["verified"], checked
    assert checked["tp2"]["num_workers"] == 2
    # Each worker is checked on every parameter it holds, against the slices the trainer's
    # tensors put there: per layer qkv_proj (weight, bias), o_proj, gate_up_proj, down_proj and
    # two norms; then embed_tokens, norm and lm_head: 2 * 7 + 3 = 17 per worker.
    assert checked["tp2"]["num_checked"] == 2 * 17, checked["tp2"]
    for engine in engines.values():
        assert ray.get(engine.weight_version.remote()) == "step-2"
        assert_engine_matches_reference(engine, trainer)
        ray.get(engine.settle.remote(), timeout=300)
        assert_engine_matches_reference(engine, trainer)


def test_a_staged_sync_switches_every_worker_of_both_replicas(setup):
    """A trainer with `staged=True`: each sync loads into a second copy of every worker's
    parameters while both engines serve, verifies each worker against its copy, then switches
    both engines (their `end`s at once); each reports its pause and when it switched. The last
    sync is not verified: each worker readies its switch at `end` (`weightsync_prepare`), not
    at `stage`, and both engines still serve the trainer's weights. The second sync's checks
    are answered by digest (`EngineVerification.by_digest`)."""
    engines, _, model, _ = setup
    staged = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        staged=True,
        verify=True,
    )
    try:
        staged.call("connect", engines)
        for i in range(3):
            staged.call("set_weights_from", 3000 + i)
            report = staged.call("sync", f"staged-{i}", verify=i < 2)
            checked = report.get("verify")
            if i < 2:
                assert checked["tp2"]["verified"] and checked["tp1"]["verified"], checked
                assert checked["tp2"]["num_workers"] == 2
                assert checked["tp2"]["num_checked"] == 2 * 17
                # The first taught the sender each worker's placements: from the second on,
                # each engine's `stage` answers by digest (docs/benchmarks.md).
                by_digest = [checked[n].get("by_digest", False) for n in ("tp2", "tp1")]
                assert by_digest == [i > 0] * 2, checked
            else:
                assert not checked, checked
            parts = report["engines"]
            print(
                f"staged-{i}: sync {report['sync_s']:.3f} s, pauses "
                f"{ {n: round(p['pause_s'] * 1e3, 1) for n, p in parts.items()} } ms, switches "
                f"{abs(parts['tp2']['switched_at'] - parts['tp1']['switched_at']) * 1e3:.1f} ms "
                f"apart"
            )
            for name, engine in engines.items():
                assert parts[name]["pause_s"] > 0
                assert ray.get(engine.weight_version.remote()) == f"staged-{i}"
                assert_engine_matches_reference(engine, staged)
    finally:
        staged.kill()


def test_a_staged_sync_that_fails_verification_is_adopted_by_neither_replica(setup):
    """A staged, verified sync into the TP=2 engine and its TP=1 replica whose check fails
    (planted on the sender's side, so both hold the new bytes in their staged copies when
    checked) is aborted before either switches: both keep their version, fingerprints and
    answers. Each engine fails its own check, the TP=2 engine's worker by worker (a first
    sync taught the sender where each worker keeps each tensor)."""
    engines, trainer, *_ = setup
    check_failed_verification_is_never_adopted(
        engines["tp2"],
        trainer,
        "tp2",
        staged=True,
        replicas={"tp1": engines["tp1"]},
        learn_first=True,
    )


def test_repeated_syncs_take_the_one_copy_path_into_every_worker(setup):
    """From the second sync on, each trainer rank writes its shards straight into the shared
    parameters of the TP=1 replica and, through each worker's placements, only the slices each
    TP worker holds into its own parameters. The second round is not verified, so the ranks
    copy through their write plans (weightsync/trainer/one_copy/writer.py); `verify` checks it after."""
    engines, trainer, *_ = setup
    for round_ in range(2):
        trainer.call("train_step", training_batch(10 + round_))
        report = trainer.call("sync", f"round-{round_}", verify=round_ == 0)
        assert report["engines"]["tp1"]["path"] == "one_copy", report["engines"]
        assert report["engines"]["tp2"]["path"] == "one_copy", report["engines"]
        # Bytes written: one model into the replica, and into the TP=2 engine the sum of its
        # workers' slices (one model, plus the norms both workers hold), not two full copies.
        nbytes = report["nbytes"]
        assert 2 * nbytes <= report["bytes_written"] < 2.05 * nbytes, report["bytes_written"]
        checked = report["verify"] if round_ == 0 else trainer.call("verify")
        assert checked["tp2"]["verified"] and checked["tp1"]["verified"], checked
        for engine in engines.values():
            assert ray.get(engine.weight_version.remote()) == f"round-{round_}"
            assert_engine_matches_reference(engine, trainer)


def test_an_update_aborted_midway_into_a_tp_engine_is_rolled_back_in_every_worker(setup):
    """One row-parallel tensor reaches both workers (each keeps its columns), then the sender
    "dies": each worker puts back what it overwrote; the engine serves its previous version."""
    engines, trainer, *_ = setup
    tp2 = engines["tp2"]
    version = ray.get(tp2.weight_version.remote())
    prints = ray.get(tp2.worker_fingerprints.remote())
    served = ray.get(tp2.generate.remote(prompt_ids()))
    half_update(
        tp2,
        next(
            s
            for s in trainer.call("refit_info")
            if s["name"].endswith("layers.0.mlp.down_proj.weight")
        ),
    )
    assert ray.get(tp2.weight_version.remote()) == version
    assert ray.get(tp2.worker_fingerprints.remote()) == prints
    assert ray.get(tp2.generate.remote(prompt_ids()))["tokens"] == served["tokens"]


def test_a_one_copy_update_aborted_without_keep_previous_is_not_served(setup):
    """Once an engine accepted a one-copy update the trainer may have written into its
    parameters: aborted without keep_previous, it refuses to serve until a sync completes."""
    engines, trainer, *_ = setup
    tp1 = engines["tp1"]
    assert ray.get(tp1.begin.remote("one-copy-half", True)) == {"one_copy": True}
    ray.get(tp1.abort.remote("sender failed"))
    with pytest.raises(
        Exception,
        match=r"does not serve: update 'one-copy-half' was aborted "
        r"after the trainer began writing",
    ):
        ray.get(tp1.generate.remote(prompt_ids()))
    report = trainer.call("sync", "after-one-copy-abort", verify=True)
    assert report["engines"]["tp1"]["path"] == "one_copy" and report["verify"]["tp1"]["verified"]
    assert_engine_matches_reference(tp1, trainer)


def test_verification_names_the_worker_and_parameter_that_differ(setup):
    """The engine reloads its starting checkpoint behind the trainer's back: each worker's
    slices then differ from the trainer's weights, and the report says which."""
    engines, trainer, model, _ = setup
    trainer.call("train_step", training_batch(20))
    assert trainer.call("sync", "before-reload", verify=True)["verify"]["tp2"]["verified"]
    ray.get(engines["tp2"].native_reload.remote(model))
    checked = trainer.call("verify")
    assert checked["tp1"]["verified"]
    assert not checked["tp2"]["verified"]
    bad = checked["tp2"]["mismatched"]
    assert any(b.startswith("worker 0: model.layers.0.self_attn.qkv_proj") for b in bad), bad
    assert any(b.startswith("worker 1: model.layers.0.self_attn.qkv_proj") for b in bad), bad
    report = trainer.call("sync", "after-reload", verify=True)
    assert report["verify"]["tp2"]["verified"], report["verify"]
    assert_engine_matches_reference(engines["tp2"], trainer)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_start(setup):
    *_, model, _ = setup
    start = time.perf_counter()
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 does not divide model .*"
        r"num_attention_heads=4",
    ):
        launcher.launch(ENGINE, model, tensor_parallel_size=3)
    assert time.perf_counter() - start < 5


def test_a_collective_transport_reaches_every_worker_of_every_engine(setup):
    """Over gloo the broadcast group is rank 0 plus every engine worker process (here 2 + 1):
    each TP worker joins it and loads its own slices of the full tensors it receives."""
    engines, _, model, _ = setup
    other = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        world_size=1,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=1,
        transport="gloo",
    )
    try:
        other.call("set_weights_from", 7)
        other.call("connect", dict(engines))
        report = other.call("sync", "gloo-1", verify=True)
        assert report["verify"]["tp2"]["verified"] and report["verify"]["tp1"]["verified"]
        assert report["engines"]["tp2"]["path"] == "buckets"
        for engine in engines.values():
            assert_engine_matches_reference(engine, other)
    finally:
        other.call("shutdown")
        other.kill()


def test_point_to_point_each_rank_sends_its_own_shards_into_every_worker(setup):
    """`point_to_point=True` (weightsync/trainer/p2p_path.py): after a first sync over gloo,
    both trainer ranks send the pieces of their own shards straight to the workers that keep
    them (the TP=2 engine's two workers, the replica's one), planned once; each worker verified
    against what it holds; the engines answer as the trainer's weights do. Rank 0 sends about
    half of the bytes: its own rows, nothing of rank 1's."""
    engines, _, model, _ = setup
    other = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        world_size=2,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=3,
        transport="gloo",
        point_to_point=True,
    )
    try:
        other.call("connect", dict(engines))
        first = other.sync("p2p-0", verify=True)
        assert first.path == "buckets" and first.verify.verified
        for step in range(2):
            other.call("train_step", training_batch(20 + step))
            report = other.sync(f"p2p-{step + 1}", verify=step == 0)
            assert report.path == "p2p", report
            assert {e.path for e in report.engines.values()} == {"p2p"}
            checked = report.verify if step == 0 else other.verify()
            assert checked["tp2"].verified and checked["tp1"].verified, checked
            assert checked["tp2"].num_checked == 2 * 17
            # One model into the replica; into the TP=2 engine its workers' slices (one model,
            # plus the norms and biases both hold).
            nbytes, sent = report.nbytes, report.bytes_written
            assert 2 * nbytes <= sent < 2.05 * nbytes, sent
            assert sum(report.rank_bytes) == sent
            assert abs(report.rank_bytes[0] - sent / 2) < 0.05 * sent, report.rank_bytes
            for engine in engines.values():
                assert ray.get(engine.weight_version.remote()) == f"p2p-{step + 1}"
                assert_engine_matches_reference(engine, other)
    finally:
        other.call("shutdown")
        other.kill()
