"""An ASGI middleware for vLLM's server that demands the API key on every route but /health.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the routes weightsync drives
(/collective_rpc, /pause, /resume, /update_weight_version, /reset_prefix_cache) stay open to every
local user. The engine actor adds this class with `--middleware` and hands the key through the
server's environment (`VLLM_API_KEY`, which vLLM reads too), so it never shows on a command line.

It is also the server's generation gate during a weight update (`Gate`): POST /weightsync/gate
{"close": true, "token": t} holds every new request but the server's control routes, waits
until the requests in flight have finished, and answers {"drained": true}; a request carrying
`X-Weightsync-Probe: t` still passes (the probe's forward on the staged weights);
{"close": false} lets the held requests go on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

KEY_VARIABLE = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
GATE_PATH = "/weightsync/gate"
PROBE_HEADER = b"x-weightsync-probe"
# Routes that never compute with the weights, which the actor drives during an update: the gate
# lets them through while it holds the others.
CONTROL_PATHS = frozenset(
    {
        "/health",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/get_world_size",
        "/v1/models",
        "/pause",
        "/resume",
        "/is_paused",
        "/metrics",
        "/version",
        GATE_PATH,
    }
)

_UNAUTHORIZED = json.dumps(
    {
        "error": "Unauthorized: send 'Authorization: Bearer <key>'; "
        "the engine actor's server_api_key() returns it"
    }
).encode()


class Gate:
    """Holds the server's requests during a weight update (see the module's docstring). One
    per server process: vLLM's default single API server."""

    def __init__(self) -> None:
        self.token: str | None = None  # set while closed
        self.inflight = 0  # requests past the gate, not finished
        self._opened = asyncio.Event()
        self._opened.set()

    async def close(self, token: str, timeout_s: float) -> dict[str, Any]:
        self.token = token
        self._opened.clear()
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return {"drained": self.inflight == 0, "inflight": self.inflight}

    def open(self) -> dict[str, Any]:
        self.token = None
        self._opened.set()
        return {"drained": True, "inflight": self.inflight}

    async def passes(self, scope: dict[str, Any]) -> None:
        """Return once `scope`'s request may reach the model: the gate open, or the request
        carrying the token of the update that closed it."""
        while self.token is not None and _header(scope, PROBE_HEADER) != self.token:
            await self._opened.wait()


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Callable, status: int, body: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class KeyOnEveryRoute:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = os.environ.get(KEY_VARIABLE)
        if not key:
            raise RuntimeError(
                f"KeyOnEveryRoute needs the server's key in ${KEY_VARIABLE}; "
                "start the server through VllmEngineActor(mode='http')"
            )
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()
        self.gate = Gate()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest
                )
        return False

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif self._authorized(scope):
            await self._gated(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})

    async def _gated(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        path = scope["path"]
        if path == GATE_PATH:
            await self._gate_route(scope, receive, send)
            return
        if path in CONTROL_PATHS:
            await self.app(scope, receive, send)
            return
        await self.gate.passes(scope)
        self.gate.inflight += 1  # no await since `passes` returned: the gate cannot close between
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.inflight -= 1

    async def _gate_route(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await _answer(send, 405, {"error": f"POST {GATE_PATH} only"})
            return
        try:
            body = json.loads(await _body(receive) or b"{}")
            if body.get("close"):
                token = str(body["token"])
                answer = await self.gate.close(token, float(body.get("timeout_s", 60.0)))
            else:
                answer = self.gate.open()
        except (ValueError, KeyError, TypeError) as exc:
            await _answer(send, 400, {"error": f"{GATE_PATH}: {type(exc).__name__}: {exc}"})
            return
        await _answer(send, 200, answer)
