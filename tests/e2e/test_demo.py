"""`weightsync demo --task sft` end to end: supervised steps, SGLang and vLLM side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightsync.apps.demo import TEXT

pytestmark = pytest.mark.slow  # a whole demo or a second Ray node: minutes


def _closeness(text: str, target: str) -> int:
    return sum(a == b for a, b in zip(text, target))


def test_demo_keeps_both_engines_in_step_and_they_learn_the_text(tmp_path):
    plot = tmp_path / "demo.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync",
            "demo",
            "--task",
            "sft",
            "--steps",
            "30",
            "--json",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout[out.stdout.index("{") :])
    steps = result["steps"]
    assert [s["step"] for s in steps] == list(range(1, 31))
    target = TEXT.removeprefix("weightsync keeps")
    for name in ("sglang", "vllm"):
        for s in steps:
            engine = s["engines"][name]
            assert engine["verified"] and engine["matches_reference"], (name, s)
            assert engine["sync_s"] > 0 and engine["gbps"] > 0
        first, last = steps[0]["engines"][name]["text"], steps[-1]["engines"][name]["text"]
        assert _closeness(last, target) > _closeness(first, target) + 8, (first, last)
    assert steps[-1]["loss"] < steps[0]["loss"] / 4
    assert plot.exists() and os.path.getsize(plot) > 10_000
