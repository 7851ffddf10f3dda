"""An ASGI middleware for vLLM's server that demands the API key on every route but /health.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the routes weightsync drives
(/collective_rpc, /pause, /resume, /update_weight_version, /reset_prefix_cache) stay open to every
local user. The engine actor adds this class with `--middleware` and hands the key through the
server's environment (`VLLM_API_KEY`, which vLLM reads too), so it never shows on a command line.

Behind the key, the server's routes pass weightsync's generation gate (weightsync/engine/gate.py):
closed during a weight update, it holds every request but `CONTROL_PATHS` and lets the update's
probe through. POST `SWITCH_PATH` {"version": v} ends a staged update in one request
(`switch`), so its pause is not several round trips long; {"version": v, "revert": true} puts
back, the same way, the weights the last switch replaced. An owner's /pause or /resume that
arrives during a switch waits for its end (and a switch for one in progress).
"""

from __future__ import annotations

import asyncio
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
# The owner's own pause routes: one arriving during a switch waits for its end, and a switch
# waits for one in progress (each would otherwise release or take the scheduler's hold midway).
OWNER_PAUSE_PATHS = frozenset({"/pause", "/resume"})
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
        "/weight_info",  # the version tag, read while a server refuses to serve
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
        self._switching = asyncio.Lock()  # a switch, or an owner's /pause or /resume

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif authorized(scope, self._digest) and scope["path"] == SWITCH_PATH:
            async with self._switching:
                await _switch_route(scope, receive, send)
        elif authorized(scope, self._digest) and scope["path"] in OWNER_PAUSE_PATHS:
            async with self._switching:
                await self.gated(scope, receive, send)
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


async def switch(engine: Any, version: str, method: str = "weightsync_commit") -> dict[str, Any]:
    """A staged update's end, inside the server: vLLM's scheduler held with the requests in
    flight kept where they are (no step runs), the prefix cache reset with those requests
    pre-empted (each goes on from its tokens so far, its KV computed again on the new weights),
    every worker switched to the staged weights (`weightsync_commit`), the weight version set
    (the tokens after the pause carry it) only when every worker switched, the scheduler
    released. When a worker's switch failed, each worker is put back on the weights it served
    (`weightsync_undo_switch`, possible with keep_previous: a worker that switched swaps back,
    one whose swap failed partway undid it itself) before the scheduler is released: "undone"
    says whether every one is (None: every worker switched).
    {"results": each worker's answer, "pause_s": seconds the scheduler was held,
    "pause_parts": those seconds in parts (`EndReport.pause_parts`)}; {"error": ...} when the
    cache could not be reset (nothing switched). `method` "weightsync_revert": the same
    steps put back the weights the last switch replaced (`VllmEngineActor.revert`). A server
    its owner had paused (vLLM's /pause) is neither held nor released here: it stays paused."""
    # Asked before the hold (one call to the engine core, outside `pause_s`).
    owner_paused = bool(await engine.is_paused()) if hasattr(engine, "is_paused") else False
    clock = PauseClock()
    core: Any = getattr(engine, "engine_core", None)
    try:
        if owner_paused:
            pass  # no step runs: the owner's pause holds the requests in flight
        elif hasattr(core, "pause_scheduler_async"):  # without pause_generation's settle sleep
            await core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:
            await engine.pause_generation(mode="keep", clear_cache=False)
        clock.mark("hold")
        for _ in range(RESET_TRIES):
            if await engine.reset_prefix_cache(True, True):  # a KV connector's cache too
                break
        else:
            return {"error": "the prefix cache could not be reset; nothing was switched"}
        clock.mark("cache")
        results = list(await engine.collective_rpc(method))
        clock.mark("switch")
        switched = [isinstance(r, dict) and bool(r.get("ok")) for r in results]
        undone = None
        if all(switched):
            await engine.update_weight_version(version)
        elif method == "weightsync_commit":
            undo = list(await engine.collective_rpc("weightsync_undo_switch", args=(switched,)))
            undone = all_undone(undo)
        clock.mark("version")
    finally:
        if not owner_paused:
            await engine.resume_generation()
        clock.mark("resume")
    return {"results": results, "undone": undone, **clock.report()}


def all_undone(replies: list[Any]) -> bool:
    """Whether every worker's `weightsync_undo_switch` answered that it serves its previous
    weights again (after a switch that failed on some worker)."""
    return all(isinstance(r, dict) and r.get("ok") and r["result"].get("undone") for r in replies)


async def _switch_route(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    if scope["type"] != "http" or scope.get("method") != "POST":
        await answer(send, 405, {"error": f"POST {SWITCH_PATH} only"})
        return
    try:
        body = json.loads(await request_body(receive) or b"{}")
        version, revert = str(body["version"]), body.get("revert", False) is True
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        await answer(send, 400, {"error": f"{SWITCH_PATH}: {type(exc).__name__}: {exc}"})
        return
    method = "weightsync_revert" if revert else "weightsync_commit"
    out = await switch(scope["app"].state.engine_client, version, method)
    await answer(send, 200 if "results" in out else 500, out)
