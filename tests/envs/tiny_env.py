"""A small real uv project registered as env "tiny" in a checkout rooted in a temporary folder:
what the env-building tests build instead of an engine env (seconds, not minutes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from weightsync.driver import envs


def uv(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [*envs.uv_command(), *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )


def make_tiny_env(root: Path, monkeypatch: pytest.MonkeyPatch, pyproject: str) -> str:
    """Env "tiny" defined by `pyproject` under `root`/envs/tiny, locked, no venv yet."""
    folder = root / "envs" / "tiny"
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(pyproject)
    uv("lock", cwd=folder)
    monkeypatch.setattr(envs, "REPO_ROOT", root)
    monkeypatch.setitem(
        envs.ENVS,
        "tiny",
        envs.EnvSpec(name="tiny", engine="packaging", engine_module="packaging", compiled=()),
    )
    return "tiny"
