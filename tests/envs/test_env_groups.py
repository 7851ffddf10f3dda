"""Dependency groups of an env: a build installs the runtime set, `--with GROUP` adds a group, and
the stamp names the groups so a build asking for one the venv lacks re-syncs. A real uv project
of three small packages (built in a temporary folder, seconds), and the engine envs' own locks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.envs.tiny_env import make_tiny_env, uv
from weightsync import cli
from weightsync.driver import envs

TINY_PYPROJECT = """\
[project]
name = "tiny-env"
version = "0"
requires-python = "==3.11.*"
dependencies = ["packaging"]

[dependency-groups]
test = ["iniconfig"]
other = ["pluggy"]

[tool.uv]
package = false
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """An env "tiny" in a checkout rooted at tmp_path: its definition, its lock, no venv yet."""
    return make_tiny_env(tmp_path, monkeypatch, TINY_PYPROJECT)


def _installed(name: str, module: str) -> bool:
    probe = f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)"
    out = subprocess.run(
        [str(envs.python_path(name)), "-c", probe], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() == "True"


def test_a_build_installs_the_runtime_set_and_no_group(tiny):
    result = envs.build(tiny, quiet=True)
    assert result["action"] == "built" and result["groups"] == []
    assert _installed(tiny, "packaging")
    assert not _installed(tiny, "iniconfig") and not _installed(tiny, "pluggy")
    assert envs.state(tiny) == "built" and envs.built_groups(tiny) == ()


def test_a_build_writes_the_bytecode_of_what_it_installs(tiny):
    # Imports read it even where PYTHONDONTWRITEBYTECODE keeps a process from writing its own.
    envs.build(tiny, quiet=True)
    out = subprocess.run(
        [
            str(envs.python_path(tiny)),
            "-c",
            "import packaging, os; print(os.path.dirname(packaging.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    pycache = os.path.join(out.stdout.strip(), "__pycache__")
    assert any(f.startswith("version.") and f.endswith(".pyc") for f in os.listdir(pycache))


def test_asking_for_a_group_the_venv_lacks_resyncs_and_the_stamp_names_it(tiny):
    envs.build(tiny, quiet=True)
    result = envs.build(tiny, groups=["test"], quiet=True)
    assert result["action"] == "updated" and result["groups"] == ["test"]
    assert _installed(tiny, "iniconfig") and not _installed(tiny, "pluggy")
    assert envs.built_groups(tiny) == ("test",)
    assert envs.build(tiny, groups=["test"], quiet=True)["action"] == "none"


def test_a_build_with_fewer_groups_is_a_no_op_that_keeps_them(tiny):
    envs.build(tiny, groups=["test", "other"], quiet=True)
    result = envs.build(tiny, quiet=True)
    assert result["action"] == "none" and result["groups"] == ["other", "test"]
    assert _installed(tiny, "iniconfig") and _installed(tiny, "pluggy")


def test_adding_a_group_keeps_the_groups_already_installed(tiny):
    envs.build(tiny, groups=["test"], quiet=True)
    assert envs.build(tiny, groups=["other"], quiet=True)["groups"] == ["other", "test"]
    assert _installed(tiny, "iniconfig") and _installed(tiny, "pluggy")


def test_a_rebuild_after_the_definition_changed_keeps_the_groups(tiny):
    envs.build(tiny, groups=["test"], quiet=True)
    pyproject = envs.definition_dir(tiny) / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "# edited\n")
    assert envs.state(tiny) == "stale"
    result = envs.build(tiny, quiet=True)
    assert result["action"] == "rebuilt" and result["groups"] == ["test"]
    assert _installed(tiny, "iniconfig")


def test_an_unknown_group_is_refused_before_anything_is_built(tiny):
    with pytest.raises(
        envs.UnknownGroupError,
        match=r"env 'tiny' has no dependency group 'nope'; its groups: test, other",
    ):
        envs.build(tiny, groups=["nope"])
    assert envs.state(tiny) == "absent"


def test_env_build_with_passes_the_groups_to_uv_sync(tiny, capsys):
    assert cli.main(["env", "build", "tiny", "--with", "test,other", "--quiet"]) == cli.EXIT_OK
    assert "built in" in capsys.readouterr().out
    assert envs.built_groups(tiny) == ("other", "test")
    assert _installed(tiny, "iniconfig") and _installed(tiny, "pluggy")


def test_env_build_with_an_unknown_group_exits_2_naming_the_groups():
    out = subprocess.run(
        [sys.executable, "-m", "weightsync", "env", "build", "vllm-cpu", "--with", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "env 'vllm-cpu' has no dependency group 'nope'; its groups: trainer, test" in out.stderr


@pytest.mark.parametrize("name", list(envs.ENVS))
def test_nemo_automodel_and_pytest_are_groups_not_runtime_dependencies_of_an_engine_env(name):
    def exported(*groups: str) -> set[str]:
        args = [a for g in groups for a in ("--group", g)]
        out = uv(
            "export",
            "--frozen",
            "--no-default-groups",
            "--no-hashes",
            *args,
            cwd=envs.definition_dir(name),
        )
        return {line.split("==")[0] for line in out.stdout.splitlines() if "==" in line}

    runtime = exported()
    assert envs.get(name).engine in runtime and "torch" in runtime and "ray" in runtime
    assert "nemo-automodel" not in runtime and "pytest" not in runtime
    assert "nemo-automodel" in exported("trainer") and "pytest" in exported("test")


def test_the_nemo_automodel_builder_names_the_trainer_group_where_it_is_missing():
    import importlib.util

    import pytest

    from weightsync.apps.automodel import build_automodel

    if importlib.util.find_spec("nemo_automodel") is not None:
        pytest.skip("nemo-automodel is installed here")
    with pytest.raises(ModuleNotFoundError, match=r"env build NAME --with trainer"):
        build_automodel("/nonexistent", device="cpu")
