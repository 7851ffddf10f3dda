"""An engine's HTTP server as a child process on loopback: start it, wait for health, talk JSON.

Used by both engine actors for their `mode="http"` delivery. The server binds 127.0.0.1 on a free
port; every request carries the API key as a bearer token when one is set.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


def cli_flags(args: dict[str, Any]) -> list[str]:
    """{"context_length": 256, "disable_cuda_graph": True} -> ["--context-length", "256",
    "--disable-cuda-graph"]; False and None are left out."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


class LocalServer:
    """`command` plus `--host 127.0.0.1 --port P`, started in its own process group."""

    def __init__(self, command: list[str], *, name: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 600.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.name = name
        self.base = f"http://127.0.0.1:{port}"
        self.api_key = api_key
        self.proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)],
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} server exited with {self.proc.returncode} at start")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"{name} server not healthy after {startup_timeout_s:.0f} s")
            time.sleep(1)

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = 300) -> tuple[int, Any]:
        """(HTTP status, decoded JSON or text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
