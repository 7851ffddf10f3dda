"""An ASGI middleware for vLLM's server that demands the API key on every route but /health.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the routes weightsync drives
(/collective_rpc, /pause, /resume, /update_weight_version, /reset_prefix_cache) stay open to every
local user. The engine actor adds this class with `--middleware` and hands the key through the
server's environment (`VLLM_API_KEY`, which vLLM reads too), so it never shows on a command line.

Behind the key, the server's routes pass weightsync's generation gate (weightsync/engine/gate.py):
closed during a weight update, it holds every request but `CONTROL_PATHS` and lets the update's
probe through. POST `SWITCH_PATH` {"version": v} ends a staged update in one request
(`switch`), so its pause is not several round trips long.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.engine.gate import GatedRoutes, answer, authorized, key_digest, request_body
from weightsync.engine.pause_clock import PauseClock

KEY_VARIABLE = "VLLM_API_KEY"
SWITCH_PATH = "/weightsync/switch"
RESET_TRIES = 3  # the prefix-cache reset inside a switch, tried again this often
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
        elif authorized(scope, self._digest) and scope["path"] == SWITCH_PATH:
            await _switch_route(scope, receive, send)
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


async def switch(engine: Any, version: str) -> dict[str, Any]:
    """A staged update's end, inside the server: vLLM's scheduler held with the requests in
    flight kept where they are (no step runs), the prefix cache reset with those requests
    pre-empted (each goes on from its tokens so far, its KV computed again on the new weights),
    every worker switched to the staged weights (`weightsync_commit`), the weight version set
    (the tokens after the pause carry it) only when every worker switched, the scheduler
    released. {"results": each worker's answer, "pause_s": seconds the scheduler was held,
    "pause_parts": those seconds in parts (`EndReport.pause_parts`)}; {"error": ...} when the
    cache could not be reset (nothing switched)."""
    clock = PauseClock()
    core: Any = getattr(engine, "engine_core", None)
    try:
        if hasattr(core, "pause_scheduler_async"):  # without pause_generation's settling sleep
            await core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:
            await engine.pause_generation(mode="keep", clear_cache=False)
        clock.mark("hold")
        for _ in range(RESET_TRIES):
            if await engine.reset_prefix_cache(True, False):
                break
        else:
            return {"error": "the prefix cache could not be reset; nothing was switched"}
        clock.mark("cache")
        results = list(await engine.collective_rpc("weightsync_commit"))
        clock.mark("switch")
        if all(isinstance(r, dict) and r.get("ok") for r in results):
            await engine.update_weight_version(version)
        clock.mark("version")
    finally:
        await engine.resume_generation()
        clock.mark("resume")
    return {"results": results, **clock.report()}


async def _switch_route(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    if scope["type"] != "http" or scope.get("method") != "POST":
        await answer(send, 405, {"error": f"POST {SWITCH_PATH} only"})
        return
    try:
        version = str(json.loads(await request_body(receive) or b"{}")["version"])
    except (ValueError, KeyError, TypeError) as exc:
        await answer(send, 400, {"error": f"{SWITCH_PATH}: {type(exc).__name__}: {exc}"})
        return
    out = await switch(scope["app"].state.engine_client, version)
    await answer(send, 200 if "results" in out else 500, out)
