"""What runs on another Ray node to build an env there, with no shared filesystem.

The driver packs this project's code and locks into a tar.gz (plain bytes) and sends it, with
this module's function, in a Ray task to the node. This module uses the standard library only
and travels by value (cloudpickle), so the node needs nothing of ours installed: the task
unpacks the archive into a node-local folder named by its content hash ($WEIGHTSYNC_NODE_DIR,
default ~/.cache/weightsync/nodes/<hash>) and runs the project's own `envs.build` there (uv sync
--locked, with uv from the `uv` package or PATH) in a fresh interpreter. The env's venv then lives on that
node, and actors start from its python.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

_MARK = "WEIGHTSYNC-BUILD "


def node_dir() -> Path:
    return Path(
        os.environ.get("WEIGHTSYNC_NODE_DIR", Path.home() / ".cache" / "weightsync" / "nodes")
    )


def unpack(archive: bytes, key: str) -> Path:
    """The project at node_dir()/key, unpacked once (concurrent tasks race safely)."""
    root = node_dir() / key
    if root.is_dir():  # os.replace below makes it appear whole
        return root
    staging = root.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(staging, filter="data")
    try:
        os.replace(staging, root)
    except OSError:  # another task unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
    return root


def build_here(env: str, key: str, archive: bytes) -> dict:
    """Runs on the target node: unpack, build `env`, return its python path (plain data)."""
    root = unpack(archive, key)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from weightsync.driver import envs; "
        "r = envs.build(sys.argv[2], quiet=True); "
        f"print({_MARK!r} + json.dumps({{**r, 'python': str(envs.python_path(sys.argv[2]))}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(root), env], capture_output=True, text=True, cwd=root
    )
    for line in result.stdout.splitlines():
        if line.startswith(_MARK):
            return {**json.loads(line.removeprefix(_MARK)), "root": str(root)}
    tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
    raise RuntimeError(
        f"building env {env!r} in {root} on this node failed (exit {result.returncode}):\n{tail}"
    )
