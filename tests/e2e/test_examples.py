"""The examples in examples/ run as a user would run them, against a real vLLM engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole demo or a second Ray node: minutes

REPO = Path(__file__).resolve().parents[2]


def _run(argv: list[str]) -> str:
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-4000:])
    return out.stdout


def _steps(stdout: str) -> list[tuple[int, str, str]]:
    # Not anchored at the line's end: Ray's log thread writes actors' lines to the same stdout
    # and may land between a print's text and its newline.
    return re.findall(r"^step (\d+) .*?\((\w+)\)  verified (True|False)", stdout, flags=re.M)


def test_torchrun_fsdp2_loop_keeps_vllm_in_step_through_trainer_sync():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    stdout = _run([torchrun, "--nproc-per-node", "2", "examples/fsdp2_torchrun.py", "--steps", "3"])
    # First sync by buckets; then the engine shares its parameters: one copy from then on.
    assert _steps(stdout) == [
        ("1", "buckets", "True"),
        ("2", "one_copy", "True"),
        ("3", "one_copy", "True"),
    ]
    assert "engine serves step-3" in stdout


def test_ray_policy_worker_keeps_vllm_in_step_through_trainer_sync():
    stdout = _run([sys.executable, "examples/ray_policy_worker.py", "--steps", "2"])
    assert _steps(stdout) == [("1", "buckets", "True"), ("2", "one_copy", "True")]
    assert "engine serves step-2" in stdout
