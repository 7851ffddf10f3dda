"""`python -m weightsync.backends.sglang.serve <sglang.launch_server flags>`: SGLang's HTTP server
with its API key taken from the environment (`WEIGHTSYNC_SGLANG_API_KEY`), not the command line,
which every local user can read in /proc, and weightsync's generation gate in front of its
routes (`KeyedGate`, weightsync/engine/gate.py), and the two routes of a staged update
(`STAGED_PATH`, `SWITCH_PATH`; docs/staged.md). Otherwise what `python -m sglang.launch_server`
does."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.engine.gate import (
    GATE_PATH,
    GatedRoutes,
    answer,
    authorized,
    key_digest,
    request_body,
)
from weightsync.engine.pause_clock import PauseClock

KEY_VARIABLE = "WEIGHTSYNC_SGLANG_API_KEY"
# POST {"op": "begin"|"end"} (SGLang's update session) or {"op": "update", "message": <JSON
# control message>}: a staged update's calls, sent to the schedulers without the tokenizer
# manager's writer lock, which would wait for every request in flight and hold new ones.
STAGED_PATH = "/weightsync/staged"
# POST {"message": <the switch's control message>, "version": v}: a staged update's end, in one
# request (`switch`); with the loader's "revert" message and {"session": true|false}, the last
# swapping switch undone the same way.
SWITCH_PATH = "/weightsync/switch"
FLUSH_TRIES = 3  # the cache flush inside a switch, tried again this often
# The owner's own pause routes: one arriving during a switch waits for its end, and a switch
# waits for one in progress (each would otherwise release or take the pause midway: a switch
# that found the server running continues generation at its end, which would undo an owner's
# pause that came meanwhile).
OWNER_PAUSE_PATHS = frozenset({"/pause_generation", "/continue_generation"})
# The control ops `STAGED_PATH` passes on (backends/sglang/loader.py): those of a staged update,
# which write only the staged copy, and those that write no weight. A load or check goes to the
# staged copy whatever the message says.
STAGED_OPS = frozenset(
    {"begin_staged", "load", "stage", "discard", "staged_support", "check", "fingerprints"}
)
# Routes that never compute with the weights, which the engine actor drives during an update:
# the gate lets them through while it holds the others (/generate, the OpenAI routes, ...).
CONTROL_PATHS = frozenset(
    {
        "/health",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/flush_cache",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/pause_generation",
        "/continue_generation",
        "/get_weight_version",
        "/update_weight_version",
        "/metrics",
    }
)


def _tensor_request(message: str, *, tp_size: int, ops: frozenset[str] = STAGED_OPS) -> Any:
    """SGLang's tensor-update request carrying one weightsync control message (its tensor
    empty) for every TP scheduler, made here from plain JSON (nothing unpickled from the
    client)."""
    import torch
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    from weightsync.backends.sglang.loader import LOADER

    control = json.loads(message)  # plain JSON, or refused
    if not isinstance(control, dict) or control.get("op") not in ops:
        raise ValueError(f"this route passes on the ops {sorted(ops)} only")
    if control["op"] in ("load", "stage"):
        message = json.dumps({**control, "staged": True})
    payload = MultiprocessingSerializer.serialize([(message, torch.empty(0))])
    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[payload] * tp_size,
        load_format=LOADER,
        flush_cache=False,
        weight_version=None,
    )


async def staged_call(
    tm: Any,
    op: str,
    message: str | None,
    *,
    tp_size: int,
    ops: frozenset[str] = STAGED_OPS,
) -> tuple[bool, str]:
    """One call of a staged update, straight to the schedulers (which run it between two of
    their forward steps): SGLang's own routes take the tokenizer manager's writer lock unless
    generation is paused, and a staged update does not pause."""
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    if op == "update":
        if message is None:
            raise ValueError("an update carries a message")
        results = await tm.update_weights_from_tensor_communicator(
            _tensor_request(message, tp_size=tp_size, ops=ops)
        )
    elif op == "begin":
        results = await tm.begin_weight_update_communicator(BeginWeightUpdateReqInput())
    elif op == "end":
        results = await tm.end_weight_update_communicator(EndWeightUpdateReqInput())
    else:
        raise ValueError(f"op {op!r}: expected 'begin', 'end' or 'update'")
    return FanOutCommunicator.merge_results(results)


async def switch(
    tm: Any, message: str, version: str, *, tp_size: int, session: bool = False
) -> dict[str, Any]:
    """A staged update's end, inside the server: generation paused with the requests in flight
    retracted (SGLang's "retract" pause: each goes back to the queue with its tokens so far and
    is computed again, on the new weights, when generation continues), the cache flushed (no
    KV of the old weights serves after the switch), every scheduler's parameters switched to
    the staged copy (`message`, the loader's "switch"), the weight version set (the tokens after
    the pause carry it) only when every scheduler switched, generation continued, SGLang's
    update session ended. {"ok": every scheduler switched, "pause_s": seconds
    generation was paused}; {"error": ...} when the cache could not be flushed (nothing
    switched). The loader's "revert" message (no update is open) puts back the weights the
    last swapping switch replaced, the same way, in an update session of its own when SGLang
    has them (`session`). A server its owner had paused (SGLang's /pause_generation) is
    neither paused nor continued here: it stays paused."""
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
        UpdateWeightVersionReqInput,
    )

    from weightsync.backends.sglang.loader import read_replies

    control = json.loads(message)
    op = control.get("op") if isinstance(control, dict) else None
    if op not in ("switch", "revert") or "reply" not in control:
        raise ValueError(f"{SWITCH_PATH} takes the switch's or the revert's control message only")
    reply_dir = str(control["reply"])
    if op == "revert" and session:
        began, text = await staged_call(tm, "begin", None, tp_size=tp_size)
        if not began:
            return {
                "error": f"SGLang's update session did not begin ({text}); nothing was switched"
            }
    owner_paused = bool(getattr(tm, "is_pause", False))  # paused by its owner: left paused
    clock = PauseClock()
    ok, text, done = False, "", False
    try:
        if not owner_paused:
            await tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        clock.mark("hold")
        for _ in range(FLUSH_TRIES):
            if (await tm.flush_cache()).success:
                break
        else:
            return {"error": "the cache could not be flushed; nothing was switched"}
        clock.mark("cache")
        done, text = await staged_call(tm, "update", message, tp_size=tp_size, ops=frozenset({op}))
        replies = read_replies(reply_dir) if done else []
        ok = len(replies) == tp_size and all(r.get("ok") for r in replies)
        clock.mark("switch")
        if ok:
            await tm.update_weight_version(
                UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
            )
        clock.mark("version")
    finally:
        if not owner_paused:
            await tm.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
        clock.mark("resume")
        if done if op == "switch" else session:
            # SGLang's update session ends after generation goes on: its end post-processes
            # the weights, which does nothing to the models a staged copy takes
            # (backends/sglang/loader.py `staged_support`).
            await staged_call(tm, "end", None, tp_size=tp_size)
    return {"ok": ok, "message": text, **clock.report()}


async def _staged_route(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    from sglang.srt.entrypoints import http_server

    if scope["type"] != "http" or scope.get("method") != "POST":
        await answer(send, 405, {"error": f"POST {scope['path']} only"})
        return
    state = http_server.get_global_state()
    tm, tp_size = state.tokenizer_manager, int(state.tokenizer_manager.server_args.tp_size or 1)
    try:
        body = json.loads(await request_body(receive) or b"{}")
        if scope["path"] == SWITCH_PATH:
            out = await switch(
                tm,
                str(body["message"]),
                str(body["version"]),
                tp_size=tp_size,
                session=body.get("session") is True,
            )
            await answer(send, 500 if "error" in out else 200, out)
            return
        op = str(body["op"])
        message = body.get("message")
        ok, text = await staged_call(
            tm, op, None if message is None else str(message), tp_size=tp_size
        )
    except (ValueError, KeyError, TypeError) as exc:
        await answer(send, 400, {"error": f"{scope['path']}: {type(exc).__name__}: {exc}"})
        return
    await answer(send, 200, {"success": ok, "message": text})


class KeyedGate:
    """SGLang's routes behind weightsync's generation gate. SGLang checks the key of its own
    routes; the gate's route and the staged update's demand it here (no key: they refuse every
    call). A switch and the owner's /pause_generation or /continue_generation run one at a
    time (`OWNER_PAUSE_PATHS`)."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str | None) -> None:
        self.app = app
        self.gated = GatedRoutes(app, CONTROL_PATHS)
        self._digest = key_digest(key) if key else None
        self._switching = asyncio.Lock()  # a switch, or an owner's pause or continue

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
        elif scope["path"] in (GATE_PATH, STAGED_PATH, SWITCH_PATH) and (
            self._digest is None or not authorized(scope, self._digest)
        ):
            await answer(send, 401, {"error": "Unauthorized: send 'Authorization: Bearer <key>'"})
        elif scope["path"] == SWITCH_PATH:
            async with self._switching:
                await _staged_route(scope, receive, send)
        elif scope["path"] == STAGED_PATH:
            await _staged_route(scope, receive, send)
        elif scope["path"] in OWNER_PAUSE_PATHS:
            async with self._switching:  # SGLang checks these routes' key itself
                await self.gated(scope, receive, send)
        else:
            await self.gated(scope, receive, send)


def server_argv(argv: list[str], key: str | None) -> list[str]:
    """SGLang's arguments with the API key; `--api-key=KEY` in one word, since a key that starts
    with "-" (token_urlsafe makes one about once in 64) would read as an option."""
    return argv + ([f"--api-key={key}"] if key else [])


def _keep_the_key_out_of_the_log() -> None:
    """SGLang logs its server arguments as it starts, its API key among them (measured with
    SGLang 0.5.23: one `server_args={...}` line on stderr): log them with the key redacted.
    tests/sglang/test_sglang_server.py greps every log of the Ray session for the key."""
    from sglang.srt.entrypoints import engine

    shown = getattr(engine, "_server_args_for_logging", None)
    if shown is None:
        return  # another SGLang: the test above says whether it logs the key

    def without_key(server_args: object) -> object:
        out = shown(server_args)
        if isinstance(out, dict):
            out = {k: "<redacted>" if "api_key" in k and v else v for k, v in out.items()}
        return out

    engine._server_args_for_logging = without_key


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    key = os.environ.pop(KEY_VARIABLE, None)
    _keep_the_key_out_of_the_log()
    app.add_middleware(KeyedGate, key=key)
    load_plugins()
    server_args = prepare_server_args(server_argv(argv, key))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
