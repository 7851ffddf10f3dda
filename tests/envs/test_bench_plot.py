"""`weightsync bench --plot` refuses before the run starts (the engines take minutes) when the plot
could not be drawn; no engine is started here."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.apps import bench

_BENCH_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if not installed
from weightsync.cli import main
from weightsync.driver import envs
def no_run(*args, **kwargs):  # the run's first step; reached only if --plot was not refused
    no_run.calls += 1
    raise RuntimeError("the bench run started")
no_run.calls = 0
envs.build = no_run
rc = main(["bench", "--plot", sys.argv[1], "--sizes", "tiny", "--engines", "vllm"])
started = "ray" in sys.modules and sys.modules["ray"].is_initialized()
print("RC", rc, "ray started:", started, "envs built:", envs.build.calls)
"""


def test_plot_without_matplotlib_is_refused_before_the_run_naming_the_extra(tmp_path: Path):
    plot = tmp_path / "bench.png"
    out = subprocess.run(
        [sys.executable, "-c", _BENCH_WITHOUT_MATPLOTLIB, str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "RC 1 ray started: False envs built: 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"--plot {plot} needs matplotlib" in out.stderr
    assert "pip install 'weightsync[plot]'" in out.stderr
    assert not plot.exists()


def _args(plot: str, **kwargs) -> argparse.Namespace:
    return argparse.Namespace(**{"plot": plot, "tp": 1, "replicas": 1, **kwargs})


def test_plot_into_a_missing_folder_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"folder .*/nowhere does not exist"):
        bench.check_plot(_args(str(tmp_path / "nowhere" / "bench.png")))


def test_plot_of_a_topology_run_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"a topology run \(--tp 2 --replicas 1\) draws no plot"):
        bench.check_plot(_args(str(tmp_path / "bench.png"), tp=2))


def test_plot_with_matplotlib_and_a_folder_passes(tmp_path: Path):
    bench.check_plot(_args(str(tmp_path / "bench.png")))
