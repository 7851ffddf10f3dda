"""`python -m weightsync.backends.sglang.serve <sglang.launch_server flags>`: SGLang's HTTP server
with its API key taken from the environment (`WEIGHTSYNC_SGLANG_API_KEY`), not the command line,
which every local user can read in /proc, and weightsync's generation gate in front of its
routes (`KeyedGate`, weightsync/engine/gate.py). Otherwise what `python -m
sglang.launch_server` does."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.engine.gate import GATE_PATH, GatedRoutes, answer, authorized, key_digest

KEY_VARIABLE = "WEIGHTSYNC_SGLANG_API_KEY"
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


class KeyedGate:
    """SGLang's routes behind weightsync's generation gate. SGLang checks the key of its own
    routes; the gate's route demands it here (no key: the route refuses every call)."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str | None) -> None:
        self.app = app
        self.gated = GatedRoutes(app, CONTROL_PATHS)
        self._digest = key_digest(key) if key else None

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
        elif scope["path"] == GATE_PATH and (
            self._digest is None or not authorized(scope, self._digest)
        ):
            await answer(send, 401, {"error": "Unauthorized: send 'Authorization: Bearer <key>'"})
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
