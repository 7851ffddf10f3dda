"""What a pip user gets in the wheel, besides the code: the license and the type marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from weightsync.driver import envs


def test_the_wheel_carries_the_license_the_type_marker_and_the_backends(tmp_path: Path):
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [*envs.uv_command(), "build", "--wheel", "-o", str(tmp_path)],
        cwd=envs.REPO_ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("weightsync-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "weightsync/py.typed" in names  # PEP 561: type checkers read our annotations
    license_files = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert license_files, names
    text = zipfile.ZipFile(wheel).read(license_files[0]).decode()
    assert "Apache License" in text and "Version 2.0" in text
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()
    assert "weightsync/backends/vllm/extension.py" in names


def test_the_scripts_bootstrap_uv_into_the_checkout_not_the_system_python(tmp_path: Path):
    """With no uv on PATH, scripts/lib.sh installs uv into .uv-bootstrap/ (a venv of its own)
    instead of pip-installing into whatever python3 is first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}"
    (bin_dir / "python3").symlink_to(python)
    work = tmp_path / "checkout"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(envs.REPO_ROOT / "scripts" / "lib.sh", work / "scripts" / "lib.sh")
    out = subprocess.run(
        ["bash", "-c", 'source scripts/lib.sh && echo "UV=${UV[*]}" && "${UV[@]}" --version'],
        cwd=work,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "UV=.uv-bootstrap/bin/uv" in out.stdout
    assert (work / ".uv-bootstrap" / "bin" / "uv").is_file()


def test_the_wheel_requires_uv_and_offers_matplotlib_as_the_plot_extra(tmp_path: Path):
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [*envs.uv_command(), "build", "--wheel", "-o", str(tmp_path)],
        cwd=envs.REPO_ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    wheel = zipfile.ZipFile(next(tmp_path.glob("weightsync-*.whl")))
    metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")))
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in metadata.decode().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    assert any(r.startswith("uv>=") for r in requires), requires
    assert "matplotlib; extra == 'plot'" in requires, requires
    assert "Provides-Extra: plot" in metadata.decode()
