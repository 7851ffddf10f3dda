"""Envs follow the driver's Python and Ray: a driver on another supported pair gets the env built
for that pair beside the locked one (its own folder, a lock resolved for it, seeded from the
definition's and cached), and a pair no engine release here runs on is refused before anything
is built. A real uv project pinning ray (built in a temporary folder), and the engine envs' own
definitions; tests/envs/test_wheel_install.py runs real drivers on other pairs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from tests.envs.tiny_env import make_tiny_env, uv
from weightsync import cli
from weightsync.driver import envs

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"

TINY_PYPROJECT = f"""\
[project]
name = "tiny-env"
version = "0"
requires-python = "=={HERE}.*"
dependencies = ["packaging", "ray==2.60.0"]

[dependency-groups]
test = ["iniconfig"]

[tool.uv]
package = false
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """An env "tiny" in a checkout rooted at tmp_path, locked for this Python with ray 2.60.0."""
    return make_tiny_env(tmp_path, monkeypatch, TINY_PYPROJECT)


def _driver_on(monkeypatch, python: str, ray: str) -> envs.HostPair:
    pair = envs.HostPair(python=python, ray=ray)
    monkeypatch.setattr(envs, "host_pair", lambda: pair)
    return pair


def _probe(name: str) -> dict:
    code = (
        "import json, sys, ray, packaging, weightsync; print(json.dumps({'python': "
        "sys.executable, 'ray': ray.__version__, 'weightsync': weightsync.__file__}))"
    )
    out = subprocess.run(
        [str(envs.python_path(name)), "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_a_driver_on_the_locked_pair_uses_the_env_folder_itself(tiny, monkeypatch):
    _driver_on(monkeypatch, HERE, "2.60.0")
    assert envs.locked_pair(tiny) == envs.HostPair(python=HERE, ray="2.60.0")
    assert envs.follows_lock(tiny)
    assert envs.env_dir(tiny) == envs.home() / "tiny"


def test_a_driver_on_another_ray_gets_its_own_env_with_that_ray(tiny, monkeypatch):
    _driver_on(monkeypatch, HERE, "2.60.0")
    envs.build(tiny, quiet=True)
    locked_python = envs.python_path(tiny)

    pair = _driver_on(monkeypatch, HERE, "2.49.2")
    assert envs.state(tiny) == "absent"
    result = envs.build(tiny, quiet=True)
    assert result["action"] == "built" and result["pair"] == str(pair)
    assert envs.env_dir(tiny) == envs.home() / "tiny" / "pairs" / f"py{HERE}-ray2.49.2"
    seen = _probe(tiny)
    assert seen["ray"] == "2.49.2"
    assert seen["python"].startswith(str(envs.env_dir(tiny)))
    # weightsync itself comes from the driver's checkout, through a .pth file
    assert seen["weightsync"] == str(envs.PACKAGE_DIR / "__init__.py")
    # the derived lock: the pair's ray, every other version kept from the definition's lock
    lock = tomllib.loads((envs.env_dir(tiny) / "uv.lock").read_text())
    assert lock["requires-python"] == f"=={HERE}.*"
    versions = {p["name"]: p["version"] for p in lock["package"]}
    locked = tomllib.loads((envs.definition_dir(tiny) / "uv.lock").read_text())
    assert versions["ray"] == "2.49.2"
    assert (
        versions["packaging"] == {p["name"]: p["version"] for p in locked["package"]}["packaging"]
    )
    assert envs.pins(tiny)["ray"] == "2.49.2"
    # the env on the locked pair is untouched
    assert locked_python.exists() and locked_python != envs.python_path(tiny)
    assert envs.build(tiny, quiet=True)["action"] == "none"


def test_the_pair_lock_is_cached_until_the_definition_changes(tiny, monkeypatch):
    _driver_on(monkeypatch, HERE, "2.49.2")
    envs.build(tiny, quiet=True)
    lock = envs.env_dir(tiny) / "uv.lock"
    resolved_at = lock.stat().st_mtime_ns
    assert envs.build(tiny, groups=["test"], quiet=True)["action"] == "updated"
    assert lock.stat().st_mtime_ns == resolved_at  # more groups: no new resolution

    pyproject = envs.definition_dir(tiny) / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"packaging"', '"packaging", "pluggy"'))
    uv("lock", cwd=envs.definition_dir(tiny))
    assert envs.state(tiny) == "stale"
    result = envs.build(tiny, quiet=True)
    assert result["action"] == "rebuilt" and result["groups"] == ["test"]
    assert "pluggy" in {p["name"] for p in tomllib.loads(lock.read_text())["package"]}


@pytest.mark.parametrize(
    "python, ray, words",
    [
        ("3.10", "2.60.0", "cannot follow a driver on Python 3.10"),
        ("3.14", "2.60.0", "cannot follow a driver on Python 3.14"),
        ("3.12", "2.44.0", "cannot follow a driver on ray 2.44.0"),
    ],
)
def test_an_unsupported_pair_is_refused_before_anything_is_built(
    tiny, monkeypatch, python, ray, words
):
    _driver_on(monkeypatch, python, ray)
    with pytest.raises(envs.UnsupportedHostError, match=words) as refused:
        envs.build(tiny, quiet=True)
    assert "3.11, 3.12, 3.13" in str(refused.value) or "pip install 'ray>=2.49'" in str(
        refused.value
    )
    assert not (envs.home() / "tiny" / ".venv").exists()
    assert not (envs.home() / "tiny" / "pairs").exists()


def test_env_build_refuses_an_unsupported_pair_with_exit_2(tiny, monkeypatch, capsys):
    _driver_on(monkeypatch, HERE, "2.40.0")
    assert cli.main(["env", "build", "tiny"]) == 2
    assert "cannot follow a driver on ray 2.40.0" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(envs.ENVS))
def test_an_engine_env_derived_for_another_pair_pins_it_and_inlines_weightsync(name):
    pair = envs.HostPair(python="3.12", ray="2.49.2")
    derived = tomllib.loads(envs.derived_pyproject(name, pair))
    original = tomllib.loads((envs.definition_dir(name) / "pyproject.toml").read_text())
    deps = derived["project"]["dependencies"]
    assert derived["project"]["requires-python"] == "==3.12.*"
    assert "ray==2.49.2" in deps and not any(d.startswith("weightsync") for d in deps)
    assert "transformers>=4.56" in deps and "torch>=2.6" in deps  # weightsync[models]
    assert "sources" not in derived["tool"]["uv"]
    assert derived["dependency-groups"] == original["dependency-groups"]
    assert derived["tool"]["uv"]["override-dependencies"] == original["tool"]["uv"].get(
        "override-dependencies"
    )
    for dep in original["project"]["dependencies"]:
        if not dep.startswith(("weightsync", "ray")):
            assert dep in deps
