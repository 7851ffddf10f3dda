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
from weightsync.wire.probe import Decoded, ProbeRequest, check_probe

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
    # Two prompts, each continued 4 steps greedily (`Probe.decode`'s default), scored too.
    assert right[0]["probe_decode_steps"] == 8 and right[0]["probe_decode_max_gap"] < 1e-3
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


def _decode_request(bound: float = 0.1) -> ProbeRequest:
    """One prompt, continued by the trainer with tokens 7, 8, 9 (log-probs -0.5, -0.6, -0.7)."""
    return ProbeRequest(
        tokens=[[1, 2, 3]],
        expected=[[-1.0, -2.0]],
        bound=bound,
        max_bound=1.0,
        decode_tokens=[[7, 8, 9]],
        decode_expected=[[-0.5, -0.6, -0.7]],
    )


def test_decode_steps_are_scored_tokens_up_to_where_the_engine_chose_otherwise():
    request = _decode_request()
    same = Decoded(tokens=[7, 8, 9], logprobs=[-0.5, -0.61, -0.7], top=[[], [], []])
    report = check_probe(request, [[-1.0, -2.0]], engine="e", version="v", decoded=[same])
    assert report.num_tokens == 5 and report.decode_steps == 3
    assert report.decode_max_gap == pytest.approx(0.01) and report.worst == (0, -2)
    # A near tie at step 1: the engine chose 4, the trainer's 8 a hair below it in its top
    # log-probs; scored there, the steps after (other contexts) not.
    tie = Decoded(
        tokens=[7, 4, 5],
        logprobs=[-0.5, -0.59, -3.0],
        top=[[(7, -0.5)], [(4, -0.59), (8, -0.6)], [(5, -3.0)]],
    )
    report = check_probe(request, [[-1.0, -2.0]], engine="e", version="v", decoded=[tie])
    assert report.decode_steps == 2 and report.decode_max_gap == pytest.approx(0.0)


def test_a_decode_step_off_fails_the_probe_naming_the_step():
    """Prefill right, decode wrong (as an engine decoding with a stale derived tensor): the
    mean (0.4 over 5 tokens) within a bound of 0.5, the step 2 nats off beyond max_bound."""
    off = Decoded(tokens=[7, 8, 9], logprobs=[-0.5, -2.6, -0.7], top=[[], [], []])
    with pytest.raises(ProbeFailed, match="scores decode step 1 of prompt 0 2 nats away"):
        check_probe(_decode_request(0.5), [[-1.0, -2.0]], engine="e", version="v", decoded=[off])
    # Another token chosen, the trainer's not among the engine's most likely.
    other = Decoded(tokens=[7, 4, 5], logprobs=[-0.5, -0.1, -0.1], top=[[], [(4, -0.1)], []])
    with pytest.raises(ProbeFailed, match="chose token 4 where the trainer's chose 8"):
        check_probe(_decode_request(), [[-1.0, -2.0]], engine="e", version="v", decoded=[other])
    with pytest.raises(ProbeFailed, match="decoded 0 prompts, expected 1"):
        check_probe(_decode_request(), [[-1.0, -2.0]], engine="e", version="v", decoded=[])


def test_decode_steps_default_to_four_with_the_models_forward_and_are_checked():
    assert Probe().decode_steps == 4 and Probe(decode=0).decode_steps == 0
    assert Probe(score=_one_token_off).decode_steps == 0
    with pytest.raises(ValueError, match="Probe.decode=-1: must be an int >= 0"):
        Probe(decode=-1)
    with pytest.raises(ValueError, match="give decode=0"):
        Probe(score=_one_token_off, decode=2)
    with pytest.raises(ValueError, match="decode_tokens of lengths"):
        ProbeRequest(
            tokens=[[1, 2]], expected=[[-1.0]], bound=0.1, decode_tokens=[[3]], decode_expected=[]
        )
    round_trip = ProbeRequest.from_dict(_decode_request().to_dict())
    assert round_trip == _decode_request() and round_trip.decode_steps == 3


@pytest.mark.parametrize("arch, layers", [("qwen3_moe", 2), ("deepseek_v2", 1)])
def test_the_probe_reports_the_experts_its_tokens_reached(arch, layers):
    """Per MoE layer, the distinct routed experts the probe's tokens reach in the trainer's
    forward (transformers' routers: (logits, weights, indices)); a dense model reports none."""
    from weightsync.apps.models import build_model
    from weightsync.trainer.probe import ProbeScorer

    model = build_model(arch, "tiny", seed=0)
    request = ProbeRequest.from_dict(ProbeScorer(Probe(decode=2), model).request())
    experts = model.config.num_experts if arch == "qwen3_moe" else model.config.n_routed_experts
    assert request.experts is not None and request.experts["experts"] == experts == 8
    assert len(request.experts["reached"]) == layers, request.experts
    assert all(1 < n <= experts for n in request.experts["reached"]), request.experts
    # A prompt of two tokens reaches at most twice top-k experts per layer.
    single = ProbeRequest.from_dict(ProbeScorer(Probe(tokens=[[5, 6]], decode=0), model).request())
    assert single.experts is not None
    assert all(n <= 2 * model.config.num_experts_per_tok for n in single.experts["reached"])
    report = check_probe(
        request,
        request.expected,
        engine="e",
        version="v",
        decoded=[
            Decoded(tokens=t, logprobs=e, top=[])
            for t, e in zip(request.decode_tokens, request.decode_expected)
        ],
    )
    assert report.experts == request.experts
    dense = ProbeScorer(Probe(decode=0), build_model("opt", "tiny", seed=0)).request()
    assert dense["experts"] is None
