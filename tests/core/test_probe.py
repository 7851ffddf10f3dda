"""The log-prob probe (`SyncOptions.probe`, weightsync/wire/probe.py) on a real 2-process gloo
FSDP2 trainer syncing into the reference receiver, whose loader is planted wrong from the first
sync: q and k swapped, a transposed tensor, a dropped tensor. Verification by fingerprints
passes each (the placements are learned from the same wrong loader); the probe fails each
before the receiver commits, naming the gap, and a right loader passes with a gap below 1e-4."""

from __future__ import annotations

import pytest
import torch

from tests.core.test_trainer_sync import _run_two_ranks_of
from weightsync import Probe, SyncOptions
from weightsync.wire.errors import ProbeFailed
from weightsync.wire.probe import ProbeRequest, check_probe

LAYER = "model.decoder.layers.0.self_attn"


def _plant(receiver, kind: str) -> None:
    """Make the receiver's loader wrong for one tensor, as a buggy engine loader would be."""
    params = dict(receiver.receiver.model.named_parameters())
    q, k = params[f"{LAYER}.q_proj.weight"], params[f"{LAYER}.k_proj.weight"]
    if kind == "qk_swapped":
        q.weight_loader = lambda _p, t: k.data.copy_(t)
        k.weight_loader = lambda _p, t: q.data.copy_(t)
    elif kind == "transposed":
        q.weight_loader = lambda p, t: p.data.copy_(t.t())
    elif kind == "dropped":
        q.weight_loader = lambda p, t: None


def _one_token_off(tokens: list[list[int]]) -> list[list[float]]:
    """The trainer's scores with one token's moved 4 nats: as an engine whose fault reaches
    a single token (one embedding row, one expert) would differ from them."""
    from weightsync.wire.probe import score_causal_lm

    scores = score_causal_lm(_one_token_off.model, tokens)  # type: ignore[attr-defined]
    scores[1][7] += 4.0
    return scores


def _probe_rank(rank: int, port: int, results, options: dict) -> None:
    from weightsync import TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    with torch.no_grad():  # sharper attention than a fresh init's, as a trained model's
        for name, param in model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                param.to_local().mul_(20.0)
    _one_token_off.model = model  # type: ignore[attr-defined]
    out: dict = {}
    for kind in ("right", "qk_swapped", "transposed", "dropped", "one_token"):
        probe = Probe(every=3, length=24)
        if kind == "one_token":  # one scored token 4 nats off, the mean still within its bound
            probe = Probe(every=3, length=24, score=_one_token_off)
        # Unverified: verification by fingerprints catches the loaders whose writes land in
        # another parameter than the one whose loader was called (q and k swapped here);
        # the probe alone is tested.
        sync = TrainerSync(model, options=SyncOptions(probe=probe, verify=False))
        receiver = None
        if rank == 0:
            receiver = ModuleWeightReceiver(build_model("opt", "tiny", seed=99), name=kind)
            _plant(receiver, kind)
        sync.connect({kind: LocalEndpoint(receiver, name=kind)} if rank == 0 else {})
        reports = []
        for version in ("v1", "v2", "v3"):  # the other rank takes part and answers None
            try:
                reports.append(sync.sync(version))
            except ProbeFailed as exc:  # rank 0 raises what failed
                out.setdefault(kind, {"error": str(exc), "type": type(exc).__name__})
        if receiver is not None:
            out.setdefault(kind, {})["reports"] = [r.to_dict() for r in reports]
            out[kind]["version"] = receiver.weight_version()
        sync.close()
    if rank == 0:
        results.put(out)
    close_trainer_group()


@pytest.fixture(scope="module")
def probed() -> dict:
    return _run_two_ranks_of(_probe_rank, {})


def test_a_right_loader_passes_the_probe_on_the_first_sync_and_at_its_cadence(probed):
    right = [r["engines"]["right"] for r in probed["right"]["reports"]]
    assert "error" not in probed["right"] and probed["right"]["version"] == "v3"
    assert right[0]["probe_gap"] < 1e-4 and right[0]["probe_max_gap"] < 1e-3
    assert "probe_gap" not in right[1]  # Probe(every=3): due again on the third sync
    assert right[2]["probe_gap"] < 1e-4


@pytest.mark.parametrize("kind", ["qk_swapped", "transposed", "dropped"])
def test_a_loader_wrong_from_the_first_sync_fails_the_probe_before_commit(probed, kind):
    result = probed[kind]
    assert result.get("type") == "ProbeFailed", result
    assert f"{kind}: update 'v1' failed the log-prob probe" in result["error"]
    assert "The update is not committed" in result["error"]
    gap = float(result["error"].split("probe tokens ")[1].split(" nats")[0])
    assert gap > 1e-2  # far above the right loader's
    # Never committed: each sync probes it again (it was never probed right) and fails again.
    assert result["version"] is None and result["reports"] == []


def test_one_token_far_off_fails_the_probe_though_the_mean_is_within_its_bound(probed):
    """46 scored tokens, one 4 nats off: a mean gap of 0.087, within `bound` (0.1); the
    default `max_bound` (1 nat) fails the sync before commit, naming the token."""
    result = probed["one_token"]
    assert result.get("type") == "ProbeFailed", result
    assert "one_token: update 'v1' failed the log-prob probe" in result["error"]
    assert "token 8 of prompt 1 4 nats away" in result["error"], result["error"]
    assert "max_bound 1;" in result["error"] and "The update is not committed" in result["error"]
    assert result["version"] is None and result["reports"] == []


def test_the_largest_gap_is_bounded_as_well_as_the_mean():
    expected = [[-1.0] * 61]
    got = [[-1.0] * 61]
    got[0][30] = -6.0  # one token 5 nats off: mean 0.082
    request = ProbeRequest(tokens=[list(range(62))], expected=expected, bound=0.1)
    assert check_probe(request, got, engine="e", version="v").max_gap == pytest.approx(5.0)
    bounded = ProbeRequest.from_dict({**request.to_dict(), "max_bound": 1.0})
    with pytest.raises(ProbeFailed, match="scores token 31 of prompt 0 5 nats away"):
        check_probe(bounded, got, engine="e", version="v")
    with pytest.raises(ValueError, match="Probe.max_bound=0: must be a positive number"):
        Probe(max_bound=0)
    assert Probe().max_bound == 1.0 and Probe(max_bound=None).max_bound is None


def test_probe_values_are_checked_when_made():
    with pytest.raises(ValueError, match="Probe.bound=0: must be a positive number"):
        Probe(bound=0)
    with pytest.raises(ValueError, match="Probe.every=-1: must be an int >= 0"):
        Probe(every=-1)
    with pytest.raises(ValueError, match="at least 2 token ids each"):
        Probe(tokens=[[5]])
    with pytest.raises(ValueError, match="expected a weightsync.Probe"):
        SyncOptions(probe={"every": 1})  # type: ignore[arg-type]
    assert Probe.of({"every": 2}) == Probe(every=2) and Probe.of(None) is None


def test_a_non_finite_or_misshaped_score_fails_the_probe():
    request = ProbeRequest(tokens=[[1, 2, 3]], expected=[[-1.0, -2.0]], bound=0.1)
    ok = check_probe(request, [[-1.01, -2.0]], engine="e", version="v")
    assert ok.max_gap == pytest.approx(0.01) and ok.worst == (0, 1)
    with pytest.raises(ProbeFailed, match="failed the log-prob probe"):
        check_probe(request, [[float("nan"), -2.0]], engine="e", version="v")
    with pytest.raises(ProbeFailed, match=r"scored \[1\] tokens per prompt, expected \[2\]"):
        check_probe(request, [[-1.0]], engine="e", version="v")


def test_an_engine_that_cannot_score_a_probe_is_refused_at_connect():
    """A receiver without a forward to score with is refused at connect, before any sync."""
    from tests.conftest import free_port
    from weightsync import TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.engine.session import EngineSession
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    class NoForward(ModuleWeightReceiver):
        _engine_probe = EngineSession._engine_probe

    init_trainer_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    model = torch.nn.Linear(4, 4)
    sync = TrainerSync(model, options=SyncOptions(probe=Probe(tokens=[[1, 2]])))
    try:
        with pytest.raises(ValueError, match="engine 'plain' cannot score this trainer's probe"):
            sync.connect({"plain": LocalEndpoint(NoForward(model), name="plain")})
        assert sync.sender is not None and "plain" not in sync.sender.engines
    finally:
        sync.close()
        close_trainer_group()
