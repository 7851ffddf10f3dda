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
vLLM's loaders put back, the same trainer syncs, the probe passes (a float32 gap below 1e-4),
and the engine's greedy tokens equal the trainer's reference."""

from __future__ import annotations

import pytest
import ray
import torch

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids, training_batch
from tests.vllm.planted import KINDS
from weightsync.apps.models import build_model, save_model
from weightsync.driver import launcher

ROLLOUT = "tests.vllm.planted.PlantedRollout"
NAME = "right"


def _sharp_checkpoint(path: str) -> str:
    """A tiny Qwen2 whose attention is sharp (q and k scaled), saved with its tokenizer."""
    model = build_model("qwen2", "tiny", seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20.0)
    return save_model(model, path)


# Two tensor-parallel workers (the probe's forward takes both; TP=1 took the same path in
# 2.5 min more of CI: the project's receiver covers one worker in tests/core/test_probe.py).
@pytest.fixture(scope="module", params=[2], ids=["tp2"])
def planted(request, tmp_path_factory):
    path = _sharp_checkpoint(str(tmp_path_factory.mktemp("qwen2-sharp")))
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(ROLLOUT, "*vllm")
    rollout = launcher.launch(ROLLOUT, path, request.param)
    trainer = launcher.TrainerGroup(
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
        model_path=path,
        # One rank: a failed sync on rank 0 would hold a second rank until `timeout_s` (the
        # probe from a 2-rank FSDP2 trainer: tests/core/test_probe.py).
        world_size=1,
        bucket_bytes=1 << 20,
        seed=0,
        lr=0.02,
        probe={"bound": 1e-3, "length": 24},
    )
    from weightsync import RayEndpoint

    def connect(name: str) -> None:  # each fault on a receiver that has seen no sync
        trainer.call("connect", {name: RayEndpoint(rollout, name=name, dispatch="weightsync")})

    before = ray.get(rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)
    trainer.call("train_step", training_batch(0))  # every tensor now differs from the engine's
    outcomes = {}
    for kind in KINDS:
        ray.get(rollout.plant.remote(kind), timeout=120)
        connect(kind)
        try:
            trainer.sync(f"{kind}-1", verify=True, engines=[kind])
            outcomes[kind] = {"error": None}
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            outcomes[kind] = {"error": f"{type(exc).__name__}: {exc}"}
        outcomes[kind]["version"] = ray.get(rollout.weightsync.remote("weight_version"))
        outcomes[kind]["tokens"] = ray.get(
            rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300
        )
        ray.get(rollout.unplant.remote(), timeout=120)
    connect(NAME)
    report = trainer.sync("right-1", verify=True, engines=[NAME])
    ray.get(rollout.weightsync.remote("settle"), timeout=300)
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    got = ray.get(rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)
    yield {"before": before, "outcomes": outcomes, "report": report, "want": want, "got": got}
    trainer.kill()
    ray.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_loader_fault_planted_from_the_first_sync_is_caught_before_commit(planted, kind):
    outcome = planted["outcomes"][kind]
    assert outcome["error"] is not None, f"{kind} passed"
    if kind == "dropped":  # its parameter holds what nothing sent: verification cannot pass it
        assert "VerificationFailed" in outcome["error"], outcome["error"][:2000]
        assert "verification incomplete, update 'dropped-1' aborted" in outcome["error"]
        assert "layers.0.mlp.down_proj.weight" in outcome["error"]
    else:  # not by fingerprints, which follow the loader's placements: by the probe
        assert "ProbeFailed" in outcome["error"], outcome["error"][:2000]
        assert f"vllm: update '{kind}-1' failed the log-prob probe" in outcome["error"]
    # Rolled back: never committed, and the engine serves the checkpoint's weights as before.
    assert outcome["version"] is None
    assert outcome["tokens"] == planted["before"]


def test_with_vllms_loaders_back_the_probe_passes_and_tokens_equal_the_reference(planted):
    report = planted["report"]
    engine = report.engines[NAME]
    assert engine.probe_gap is not None and engine.probe_gap < 1e-4, engine
    assert report.verify is not None and report.verify[NAME].verified
    assert planted["got"] == planted["want"]["tokens"]
