"""The main job as RL: `weightsync demo` (GRPO) with SGLang and vLLM sampling, a seeded short run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a whole demo or a second Ray node: minutes


def _demo(tmp_path, steps: int, *args: str) -> dict:
    plot = tmp_path / "grpo.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync",
            "demo",
            "--steps",
            str(steps),
            "--seed",
            "0",
            "--json",
            "--plot",
            str(plot),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-4000:])
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert plot.exists() and os.path.getsize(plot) > 10_000
    return result


def _assert_learned_in_step(result: dict, engines: list[str], num_steps: int) -> None:
    steps = result["steps"]
    assert [s["step"] for s in steps] == list(range(1, num_steps + 1))
    assert result["first_sync"]["verified"] == dict.fromkeys(engines, True)
    for name in engines:
        for s in steps:
            engine = s["engines"][name]
            assert engine["verified"], (name, s["step"])
            # Sampled by the weights synced at the end of the step before, and only by them.
            assert engine["versions"] == [f"step-{s['step'] - 1}"], (name, s["step"])
            assert engine["num_rollouts"] == 2 * 8
            assert 0 <= engine["kl"] and engine["mean_abs"] < result["mismatch_bound"]
        first = sum(s["engines"][name]["reward"] for s in steps[:3]) / 3
        last = sum(s["engines"][name]["reward"] for s in steps[-3:]) / 3
        assert last > first + 0.15, (name, first, last)
    assert all(s["sync_s"] > 0 and s["rollout_s"] > 0 and s["train_s"] > 0 for s in steps)


def test_grpo_with_sglang_and_vllm_sampling_learns_and_every_rollout_is_on_the_synced_version(
    tmp_path,
):
    result = _demo(tmp_path, 12)
    assert result["ok"] and result["engines"] == ["sglang", "vllm"]
    assert result["learning_judged"]  # 12 steps are enough to judge the reward's rise
    _assert_learned_in_step(result, ["sglang", "vllm"], 12)


def test_grpo_with_a_rope_model_on_vllm_learns_with_the_learner_in_step(tmp_path):
    # One engine samples half as many rollouts per step as two: more steps.
    result = _demo(tmp_path, 16, "--arch", "qwen2", "--engines", "vllm")
    assert result["ok"] and result["arch"] == "qwen2"
    _assert_learned_in_step(result, ["vllm"], 16)


def test_grpo_off_policy_samples_while_both_engines_sync_and_tags_every_rollouts_version(
    tmp_path,
):
    """`--off-policy`: staged syncs run while the engines sample; every rollout is tagged with
    the version that served it (lag 0 or 1 behind the learner), the lag-1 ones differ from the
    learner's weights by a whole update (their tag is true), and the run still learns."""
    result = _demo(tmp_path, 12, "--off-policy")
    assert result["ok"] and result["off_policy"], result["failures"]
    assert result["learning_judged"]
    engines = ["sglang", "vllm"]
    assert result["first_sync"]["verified"] == dict.fromkeys(engines, True)
    assert result["last_sync"] == {"version": "step-12", "verified": dict.fromkeys(engines, True)}
    bound = result["mismatch_bound"]
    steps = result["steps"]
    for name in engines:
        lags = []
        for s in steps:
            engine = s["engines"][name]
            assert engine["num_rollouts"] == 2 * 8 and len(engine["lags"]) == 2 * 8
            assert set(engine["lags"]) <= ({0} if s["step"] == 1 else {0, 1}), (name, s)
            assert engine["versions"] == sorted(
                {f"step-{s['step'] - 1 - g}" for g in engine["lags"]}
            )
            if 0 in engine["lags"]:
                assert engine["mean_abs"] < bound
            if 1 in engine["lags"]:
                assert engine["stale_mean_abs"] > 100 * bound  # a whole update: tenths of a nat
            if s["step"] == 1:
                assert engine["verified"] is None  # no sync ran in the first step
            else:
                # The sync of the step before ran during this step, staged: a short switch.
                assert engine["verified"] and s["synced"] == f"step-{s['step'] - 1}"
                assert 0 < engine["pause_s"] < engine["sync_s"]
            lags += engine["lags"]
        assert lags.count(1) > 0, name
        first = sum(s["engines"][name]["reward"] for s in steps[:3]) / 3
        last = sum(s["engines"][name]["reward"] for s in steps[-3:]) / 3
        assert last > first + 0.15, (name, first, last)
    # Sampling overlapped the syncs: the driver waited for them for less than they took.
    later = steps[1:]
    assert sum(s["sync_wait_s"] for s in later) < sum(s["sync_s"] for s in later)
