"""An ASGI middleware for vLLM's server that demands the API key on every route but /health.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the routes weightsync drives
(/collective_rpc, /pause, /resume, /update_weight_version, /reset_prefix_cache) stay open to every
local user. The engine actor adds this class with `--middleware` and hands the key through the
server's environment (`VLLM_API_KEY`, which vLLM reads too), so it never shows on a command line.

Behind the key, the server's routes pass weightsync's generation gate (weightsync/engine/gate.py):
closed during a weight update, it holds every request but `CONTROL_PATHS` and lets the update's
probe through.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.engine.gate import GatedRoutes, authorized, key_digest

KEY_VARIABLE = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
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
    }
)

_UNAUTHORIZED = json.dumps(
    {
        "error": "Unauthorized: send 'Authorization: Bearer <key>'; "
        "the engine actor's server_api_key() returns it"
    }
).encode()


class KeyOnEveryRoute:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = os.environ.get(KEY_VARIABLE)
        if not key:
            raise RuntimeError(
                f"KeyOnEveryRoute needs the server's key in ${KEY_VARIABLE}; "
                "start the server through VllmEngineActor(mode='http')"
            )
        self.app = app
        self._digest = key_digest(key)
        self.gated = GatedRoutes(app, CONTROL_PATHS)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif authorized(scope, self._digest):
            await self.gated(scope, receive, send)
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
