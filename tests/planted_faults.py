"""The planted-loader probe runs shared by the engine suites (tests/vllm/test_vllm_probe.py,
tests/sglang/test_sglang_probe.py): a sharp checkpoint, each fault planted in the engine's own
loaders and synced from the first sync of a fresh connection, then the right loaders."""

from __future__ import annotations

from typing import Any

import ray
import torch

from tests.engine_checks import MAX_NEW_TOKENS, prompt_ids, training_batch
from weightsync.apps.models import build_model, save_model

RIGHT = "right"


def sharp_checkpoint(arch: str, path: str) -> str:
    """A tiny model whose attention is sharp (q and k scaled, as a trained model's attention
    is: a swap of q and k then moves the log-probs well above float32 noise), saved with its
    tokenizer."""
    model = build_model(arch, "tiny", seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20.0)
    return save_model(model, path)


def run_planted(trainer, rollout, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Train a step, then for each fault: plant it (`rollout.plant(kind)`), connect the rollout
    under the fault's name (a receiver that has seen no sync: loaders are learned on first
    sight), sync it verified and record the error, the version and the greedy tokens, and
    `rollout.unplant()` (the engine's own loaders back, a fresh receiver); then connect `RIGHT`,
    sync, and record the report, the trainer's reference and the engine's tokens."""

    def connect(name: str) -> None:
        # The plain form of a framework's own actor: no weightsync object crosses to the trainer.
        trainer.call("connect", {name: {"actor": rollout, "dispatch": "weightsync"}})

    def tokens() -> list[list[int]]:
        return ray.get(rollout.rollout.remote(prompt_ids(), MAX_NEW_TOKENS), timeout=300)

    before = tokens()
    trainer.call("train_step", training_batch(0))  # every tensor now differs from the engine's
    outcomes: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        ray.get(rollout.plant.remote(kind), timeout=120)
        connect(kind)
        try:
            trainer.sync(f"{kind}-1", verify=True, engines=[kind])
            outcomes[kind] = {"error": None}
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the caller
            outcomes[kind] = {"error": f"{type(exc).__name__}: {exc}"}
        outcomes[kind]["version"] = ray.get(rollout.weightsync.remote("weight_version"))
        outcomes[kind]["tokens"] = tokens()
        ray.get(rollout.unplant.remote(), timeout=120)
    connect(RIGHT)
    # While an update is open the framework's own generation is refused (check_serving).
    ray.get(rollout.weightsync.remote("begin", "open"), timeout=120)
    try:
        tokens()
        refused = None
    except Exception as exc:  # noqa: BLE001 - asserted by the caller
        refused = str(exc)
    ray.get(rollout.weightsync.remote("abort", "the test's"), timeout=120)
    report = trainer.sync(f"{RIGHT}-1", verify=True, engines=[RIGHT])
    ray.get(rollout.weightsync.remote("settle"), timeout=300)
    want = trainer.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
    got = tokens()
    # A second step reaches the same engine by the one-copy path (shared memory, same host).
    trainer.call("train_step", training_batch(1))
    second = trainer.sync(f"{RIGHT}-2", verify=True, engines=[RIGHT])
    ray.get(rollout.weightsync.remote("settle"), timeout=300)
    return {
        "before": before,
        "outcomes": outcomes,
        "refused": refused,
        "report": report,
        "want": want,
        "got": got,
        "second": second,
        "second_version": ray.get(rollout.weightsync.remote("weight_version")),
        "second_want": trainer.call(
            "reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS
        ),
        "second_got": tokens(),
    }


def check_caught(planted: dict[str, Any], kind: str, *, engine: str, dropped_param: str) -> None:
    """The fault `kind` failed its sync before commit: a dropped tensor by verification (its
    parameter holds nothing the trainer sent), the others by the probe (fingerprints follow the
    loader's placements); rolled back, the engine serves what it served before."""
    outcome = planted["outcomes"][kind]
    error = outcome["error"]
    assert error is not None, f"{kind} passed"
    if kind == "dropped":
        assert "VerificationFailed" in error, error[:2000]
        assert "verification incomplete, update 'dropped-1' aborted" in error
        assert dropped_param in error
    else:
        assert "ProbeFailed" in error, error[:2000]
        assert f"{engine}: update '{kind}-1' failed the log-prob probe" in error
    assert outcome["version"] is None
    assert outcome["tokens"] == planted["before"]


def check_right(planted: dict[str, Any], decode_max: float = 1e-3) -> None:
    """With the engine's own loaders the probe passes (float32 gap below 1e-4, its decode
    steps scored too), verified, and the engine's greedy tokens equal the trainer's
    reference."""
    report = planted["report"]
    synced = report.engines[RIGHT]
    assert synced.path == "buckets", synced
    # float32: the prefill within 1e-4 of the trainer; each prompt's 4 greedy decode steps
    # (`Probe.decode`'s default), scored too, within `decode_max`.
    assert synced.probe_gap is not None and synced.probe_gap < 1e-3, synced
    assert synced.probe_decode_steps == 8, synced
    assert synced.probe_decode_max_gap is not None and synced.probe_decode_max_gap < decode_max
    assert synced.probe_max_gap is not None
    print(
        f"probe: mean {synced.probe_gap:.2e}, decode steps at most {synced.probe_decode_max_gap:.2e}"
    )
    assert report.verify is not None and report.verify[RIGHT].verified
    assert planted["got"] == planted["want"]["tokens"]


def check_framework_actor(planted: dict[str, Any]) -> None:
    """The framework's own actor, reached through its dispatch method: its own generation is
    refused while an update is open; after the first sync (buckets) the next one takes the
    one-copy path, verified, and its own generate equals the trainer's reference."""
    assert (
        planted["refused"] is not None
        and "does not serve during update 'open'" in (planted["refused"])
    ), planted["refused"]
    second = planted["second"]
    assert second.engines[RIGHT].path == "one_copy", second.engines[RIGHT]
    assert second.verify is not None and second.verify[RIGHT].verified
    assert planted["second_version"] == f"{RIGHT}-2"
    assert planted["second_got"] == planted["second_want"]["tokens"]
