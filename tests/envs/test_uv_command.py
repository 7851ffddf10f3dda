"""Where weightsync finds uv to build envs: the `uv` package it depends on, else PATH; never by
installing anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_UV_COMMAND = "from weightsync.driver import envs; print(envs.uv_command())"


def _run(code: str, *, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )


def test_uv_is_the_uv_packages_binary_with_no_uv_on_path(tmp_path: Path):
    import uv

    out = _run(_UV_COMMAND, path=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr([uv.find_uv_bin()])


def test_without_the_uv_package_uv_on_path_is_used(tmp_path: Path):
    fake_uv = tmp_path / "uv"
    fake_uv.write_text("#!/bin/sh\n")
    fake_uv.chmod(0o755)
    out = _run("import sys; sys.modules['uv'] = None; " + _UV_COMMAND, path=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr([str(fake_uv)])


def test_with_no_uv_anywhere_the_error_names_the_fix_and_nothing_is_installed(tmp_path: Path):
    """A python3 and a pip first on PATH record any call: neither may run."""
    calls = tmp_path / "calls"
    for tool in ("python3", "pip", "pip3"):
        (tmp_path / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {calls}\nexit 1\n')
        (tmp_path / tool).chmod(0o755)
    out = _run("import sys; sys.modules['uv'] = None; " + _UV_COMMAND, path=str(tmp_path))
    assert out.returncode != 0
    assert "RuntimeError: uv not found" in out.stderr
    assert f"`{sys.executable} -m pip install uv` (weightsync depends on it)" in out.stderr
    assert not calls.exists(), calls.read_text()
