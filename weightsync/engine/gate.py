"""A generation gate for an engine's HTTP server, as ASGI middleware logic (weightsync's
middleware in vLLM's server, backends/vllm/guard.py, and in SGLang's, backends/sglang/serve.py).

During a weight update the engine actor closes it: POST /weightsync/gate {"close": true,
"token": t} holds every new request but the server's control routes (those that never compute
with the weights: the update's own calls), waits until the requests in flight have finished
(each answer computed on one version), and answers {"drained": true, "inflight": 0}; a request
carrying `X-Weightsync-Probe: t` still passes (the probe's forward on the staged weights,
weightsync/wire/probe.py); {"close": false} lets the held requests go on. After an update that
was aborted with the weights partly written (the engine does not serve until a sync completes),
{"close": false, "refuse": reason} answers every held and new request 503 with the reason
instead, until the next {"close": false}. The caller checks the API key before handing a
request here. One gate per server process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

GATE_PATH = "/weightsync/gate"
PROBE_HEADER = b"x-weightsync-probe"
DRAIN_S = 240.0  # how long closing waits for a server's requests in flight to finish


class Gate:
    """Holds the server's requests during a weight update (see the module's docstring)."""

    def __init__(self) -> None:
        self.token: str | None = None  # set while closed
        self.refused: str | None = None  # why the open gate answers 503 to every request
        self.inflight = 0  # requests past the gate, not finished
        self._opened = asyncio.Event()
        self._opened.set()

    async def close(self, token: str, timeout_s: float) -> dict[str, Any]:
        self.token, self.refused = token, None  # held now; the update's probe passes
        self._opened.clear()
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return {"drained": self.inflight == 0, "inflight": self.inflight}

    def open(self, refuse: str | None = None) -> dict[str, Any]:
        self.token, self.refused = None, refuse
        self._opened.set()
        return {"drained": True, "inflight": self.inflight}

    async def passes(self, scope: dict[str, Any]) -> None:
        """Return once `scope`'s request may reach the model: the gate open, or the request
        carrying the token of the update that closed it."""
        while self.token is not None and _header(scope, PROBE_HEADER) != self.token:
            await self._opened.wait()


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def authorized(scope: dict[str, Any], digest: bytes) -> bool:
    """Whether the request carries `Authorization: Bearer <key>` for the key of `digest`."""
    value = _header(scope, b"authorization")
    if value is None:
        return False
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_digest(token), digest)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def request_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def answer(send: Callable, status: int, body: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class GatedRoutes:
    """A server's routes behind a `Gate`: `control` paths always pass, `GATE_PATH` drives the
    gate, every other request waits while it is closed (unless it carries the token)."""

    def __init__(self, app: Callable[..., Awaitable[None]], control: frozenset[str]) -> None:
        self.app = app
        self.control = control | {GATE_PATH}
        self.gate = Gate()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        path = scope["path"]
        if path == GATE_PATH:
            await self._gate_route(scope, receive, send)
            return
        if path in self.control:
            await self.app(scope, receive, send)
            return
        await self.gate.passes(scope)
        if self.gate.refused is not None:
            await answer(send, 503, {"error": self.gate.refused})
            return
        self.gate.inflight += 1  # no await since `passes` returned: the gate cannot close between
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.inflight -= 1

    async def _gate_route(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await answer(send, 405, {"error": f"POST {GATE_PATH} only"})
            return
        try:
            body = json.loads(await request_body(receive) or b"{}")
            if body.get("close"):
                token = str(body["token"])
                out = await self.gate.close(token, float(body.get("timeout_s", 60.0)))
            else:
                refuse = body.get("refuse")
                out = self.gate.open(None if refuse is None else str(refuse))
        except (ValueError, KeyError, TypeError) as exc:
            await answer(send, 400, {"error": f"{GATE_PATH}: {type(exc).__name__}: {exc}"})
            return
        await answer(send, 200, out)


# ---- the engine actor's side: closing and opening a server's gate ----------------------------
Request = Callable[..., tuple[int, Any]]  # (method, path, body) -> (status, JSON)


def close_gate(request: Request, engine: str) -> str:
    """Close the server's gate for an update (its requests in flight finished); the update's
    token, which its probe request carries. Fails, the gate opened again, when requests are
    still running after `DRAIN_S`."""
    token = secrets.token_urlsafe(16)
    status, out = request("POST", GATE_PATH, {"close": True, "token": token, "timeout_s": DRAIN_S})
    if status != 200 or not isinstance(out, dict):
        raise RuntimeError(f"{engine} server {GATE_PATH} answered {status}: {out}")
    if not out.get("drained"):
        open_gate(request, engine)
        raise RuntimeError(
            f"{engine} server: {out.get('inflight')} request(s) still running {DRAIN_S:g} s "
            f"after the update asked generation to stop; the update was not begun"
        )
    return token


def open_gate(request: Request, engine: str, *, refuse: str | None = None) -> None:
    """Let the held requests go on; with `refuse` (why the engine does not serve), answer
    them, and every later one until the gate opens again, 503 with it."""
    body: dict[str, Any] = {"close": False}
    if refuse is not None:
        body["refuse"] = f"{engine} engine does not serve: {refuse}"
    status, out = request("POST", GATE_PATH, body)
    if status != 200:
        raise RuntimeError(f"{engine} server {GATE_PATH} answered {status}: {out}")
