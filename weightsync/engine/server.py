"""An engine's HTTP server as a child process on loopback: start it, wait for health, talk JSON;
or one its owner started (`RemoteServer`): check it answers, talk JSON, leave it running.

Used by both engine actors for their `mode="http"` delivery and their `url=` attachment. The server binds 127.0.0.1 on a free
port; every request carries the API key as a bearer token when one is set.

The server runs under a small guard process (`_GUARD`, in the server's process group) that stops
the whole group when the process that started it is gone, however it went: an engine actor
killed by Ray (an out-of-memory kill, a test that failed mid-start) must not leave its server,
and the server's own children, behind.

The port is found by binding a socket to port 0 and closing it, then handed to the server: the
engines' servers take a port number, not a socket, and derive other ports from it (SGLang), so
they cannot be started on port 0 and asked which port they got. Another process can take the
port in between; a server that exits at start while its port is in use is started again on a
new port, up to `_START_ATTEMPTS` times.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

_START_ATTEMPTS = 3

_GUARD = """
import os, signal, subprocess, sys, time
owner = int(sys.argv[1])
server = subprocess.Popen(sys.argv[2:])
while server.poll() is None:
    if os.getppid() != owner:  # the starting process died: stop the group, this guard too
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(server.returncode)
"""
"""Run as `python -c _GUARD <owner pid> <server command...>`: the server as its child, exiting
with its code; both stopped once the owner is gone."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


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


def http_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    api_key: str | None = None,
    timeout: float = 300,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One JSON request: (HTTP status, decoded JSON or text), an error status included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class RemoteServer:
    """An engine's HTTP server its owner started (a framework's `vllm serve`, its
    `sglang.launch_server`): requests carry `api_key` as a bearer token; `shutdown` leaves the
    server running. ConnectionError naming the URL when /health does not answer 200."""

    def __init__(
        self, url: str, *, name: str, api_key: str | None = None, timeout_s: float = 30.0
    ) -> None:
        self.name = name
        self.base = url.rstrip("/")
        self.api_key = api_key
        try:
            status, out = self.request("GET", "/health", timeout=timeout_s)
        except OSError as exc:
            raise ConnectionError(
                f"{name} server at {url}: no answer to GET /health ({exc}); is it running there?"
            ) from None
        if status != 200:
            raise ConnectionError(f"{name} server at {url}: GET /health answered {status}: {out}")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 300,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON or text)."""
        return http_json(
            method,
            self.base + path,
            body,
            api_key=self.api_key,
            timeout=timeout,
            headers=headers,
        )

    def info(self, path: str, *, key_name: str, fix: str) -> dict[str, Any]:
        """GET `path` (a route answering what the server runs) with the key, then refuse a server
        weightsync must not drive: PermissionError when it demands a key and none or another was
        given (`key_name`: where its key is set), or when it answers `path` without a key (any
        local user could then drive its updates: `fix` says how to start it instead)."""
        where = f"{self.name} server at {self.base}"
        status, out = self.request("GET", path, timeout=120)
        if status == 401:
            raise PermissionError(
                f"{where} demands an API key: pass api_key= the key it was started with "
                f"({key_name})"
                if self.api_key is None
                else f"{where} refused the API key given (401): pass api_key= the key the "
                f"server was started with ({key_name})"
            )
        if status == 404:
            raise ValueError(f"{where} has no {path.split('?')[0]}: {fix}")
        if status != 200 or not isinstance(out, dict):
            raise RuntimeError(f"{where}: {path} answered {status}: {out}")
        if self.api_key is None or http_json("GET", self.base + path)[0] != 401:
            raise PermissionError(
                f"{where} answers {path.split('?')[0]} without a key, so any local user could "
                f"drive its weight updates: {fix}, and pass that key as api_key="
            )
        return out

    def shutdown(self) -> None:
        """Nothing: the server is its owner's."""


class LocalServer:
    """`command` plus `--host 127.0.0.1 --port P`, started in its own process group."""

    def __init__(
        self,
        command: list[str],
        *,
        name: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.api_key = api_key
        for attempt in range(1, _START_ATTEMPTS + 1):
            port = _free_port()
            self.base = f"http://127.0.0.1:{port}"
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _GUARD,
                    str(os.getpid()),
                    *command,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
            if self._wait_healthy(startup_timeout_s):
                return
            try:  # what it started goes with it, and frees the port if it was the holder
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if not _port_in_use(port) or attempt == _START_ATTEMPTS:
                raise RuntimeError(
                    f"{name} server exited with {self.proc.returncode} at start "
                    f"(port {port}, attempt {attempt} of {_START_ATTEMPTS})"
                )

    def _wait_healthy(self, startup_timeout_s: float) -> bool:
        """True once /health answers 200; False if the server exited first."""
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                return False
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(
                    f"{self.name} server not healthy after {startup_timeout_s:.0f} s"
                )
            time.sleep(1)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 300,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(HTTP status, decoded JSON or text)."""
        return http_json(
            method,
            self.base + path,
            body,
            api_key=self.api_key,
            timeout=timeout,
            headers=headers,
        )

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
