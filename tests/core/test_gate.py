"""The generation gate of weightsync's middleware for vLLM's server (backends/vllm/guard.py), as
ASGI calls against an app that stands for vLLM's routes: closing it waits for the requests in
flight, holds new ones (control routes excepted), lets the update's probe request through, and
opening it releases the held ones. The real server behind it: tests/reliability/test_vllm_pause.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from weightsync.backends.vllm.guard import KeyOnEveryRoute
from weightsync.engine.gate import GATE_PATH

KEY = "k" * 24


class _App:
    """Answers every request after `release` is set for its path (a generation in progress)."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send) -> None:
        event = self.release.setdefault(scope["path"], asyncio.Event())
        await event.wait()
        self.done.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _call(guard, path: str, body: dict | None = None, probe: str | None = None):
    headers = [(b"authorization", f"Bearer {KEY}".encode())]
    if probe is not None:
        headers.append((b"x-weightsync-probe", probe.encode()))
    scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body or {}).encode()}

    async def send(message):
        sent.append(message)

    async def run():
        await guard(scope, receive, send)
        return sent

    return asyncio.ensure_future(run())


def _json(sent: list[dict]) -> dict:
    assert sent[0]["status"] == 200, sent
    return json.loads(sent[1]["body"])


def test_the_gate_drains_holds_lets_the_probe_through_and_releases(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)

    async def scenario() -> None:
        app = _App()
        guard = KeyOnEveryRoute(app)
        app.release["/v1/completions"] = asyncio.Event()
        running = _call(guard, "/v1/completions")  # in flight when the update begins
        await asyncio.sleep(0.01)
        closing = _call(guard, GATE_PATH, {"close": True, "token": "t1", "timeout_s": 5})
        await asyncio.sleep(0.05)
        assert not closing.done()  # waits for the request in flight
        app.release["/v1/completions"].set()
        assert _json(await closing) == {"drained": True, "inflight": 0}
        assert (await running)[0]["status"] == 200
        app.release["/v1/chat/completions"] = asyncio.Event()
        app.release["/v1/chat/completions"].set()
        held = _call(guard, "/v1/chat/completions")  # any generation route
        wrong = _call(guard, "/v1/completions", probe="t0")  # another update's token
        app.release["/collective_rpc"] = asyncio.Event()
        app.release["/collective_rpc"].set()
        control = _call(guard, "/collective_rpc")
        probe = _call(guard, "/v1/completions", probe="t1")
        assert (await probe)[0]["status"] == 200
        assert (await control)[0]["status"] == 200
        await asyncio.sleep(0.05)
        assert not held.done() and not wrong.done()
        assert _json(await _call(guard, GATE_PATH, {"close": False}))["drained"]
        assert (await held)[0]["status"] == 200 and (await wrong)[0]["status"] == 200

    asyncio.run(scenario())


def test_a_gate_that_cannot_drain_in_time_says_so_and_bad_bodies_are_refused(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)

    async def scenario() -> None:
        app = _App()
        guard = KeyOnEveryRoute(app)
        stuck = _call(guard, "/v1/completions")  # never released
        await asyncio.sleep(0.01)
        answer = await _call(guard, GATE_PATH, {"close": True, "token": "t", "timeout_s": 0.05})
        assert _json(answer) == {"drained": False, "inflight": 1}
        bad = await _call(guard, GATE_PATH, {"close": True})  # no token
        assert bad[0]["status"] == 400 and b"KeyError" in bad[1]["body"]
        _json(await _call(guard, GATE_PATH, {"close": False}))
        stuck.cancel()

    asyncio.run(scenario())


def test_a_gate_opened_refusing_answers_held_and_new_requests_503_until_opened_again(monkeypatch):
    """After an update aborted with the weights partly written the actor opens the gate with
    the reason: the requests it held and every later one get 503 and the reason, control routes
    still pass; the next update's closed gate lets its probe through, and its plain opening
    serves again."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    reason = "vllm engine does not serve: update 'v2' was aborted after 1 bucket(s); sync again"

    async def scenario() -> None:
        app = _App()
        for path in ("/v1/completions", "/collective_rpc"):
            app.release[path] = asyncio.Event()
            app.release[path].set()
        guard = KeyOnEveryRoute(app)
        _json(await _call(guard, GATE_PATH, {"close": True, "token": "t2", "timeout_s": 5}))
        held = _call(guard, "/v1/completions")
        await asyncio.sleep(0.05)
        assert not held.done()
        _json(await _call(guard, GATE_PATH, {"close": False, "refuse": reason}))
        for answer in (await held, await _call(guard, "/v1/completions")):
            assert answer[0]["status"] == 503 and json.loads(answer[1]["body"]) == {"error": reason}
        assert (await _call(guard, "/collective_rpc"))[0]["status"] == 200
        assert app.done == ["/collective_rpc"]  # nothing reached the model
        _json(await _call(guard, GATE_PATH, {"close": True, "token": "t3", "timeout_s": 5}))
        assert (await _call(guard, "/v1/completions", probe="t3"))[0]["status"] == 200
        _json(await _call(guard, GATE_PATH, {"close": False}))
        assert (await _call(guard, "/v1/completions"))[0]["status"] == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("path", [GATE_PATH, "/v1/completions"])
def test_the_gate_route_and_held_routes_demand_the_key(monkeypatch, path):
    monkeypatch.setenv("VLLM_API_KEY", KEY)

    async def scenario() -> list[dict]:
        guard = KeyOnEveryRoute(_App())
        sent: list[dict] = []
        scope = {"type": "http", "path": path, "method": "POST", "headers": []}

        async def receive():
            return {"type": "http.request", "body": b"{}"}

        async def send(message):
            sent.append(message)

        await guard(scope, receive, send)
        return sent

    assert asyncio.run(scenario())[0]["status"] == 401


def test_sglangs_gate_demands_the_key_on_its_own_route_and_holds_generation():
    """In SGLang's server (weightsync.backends.sglang.serve) SGLang checks the key of its own
    routes; the gate's route checks it itself, and /generate waits while the gate is closed
    while SGLang's update routes pass."""
    from weightsync.backends.sglang.serve import KeyedGate

    async def scenario() -> None:
        app = _App()
        for path in ("/generate", "/update_weights_from_tensor"):
            app.release[path] = asyncio.Event()
            app.release[path].set()
        gate = KeyedGate(app, key=KEY)
        keyless = KeyedGate(app, key=None)
        sent: list[dict] = []
        scope = {"type": "http", "path": GATE_PATH, "method": "POST", "headers": []}

        async def receive():
            return {"type": "http.request", "body": b"{}"}

        async def send(message):
            sent.append(message)

        await gate(scope, receive, send)
        assert sent[0]["status"] == 401
        refused = await _call(keyless, GATE_PATH, {"close": False})  # with the key: no key set
        assert refused[0]["status"] == 401
        _json(await _call(gate, GATE_PATH, {"close": True, "token": "t", "timeout_s": 1}))
        held = _call(gate, "/generate")
        control = _call(gate, "/update_weights_from_tensor")
        assert (await control)[0]["status"] == 200
        await asyncio.sleep(0.05)
        assert not held.done()
        _json(await _call(gate, GATE_PATH, {"close": False}))
        assert (await held)[0]["status"] == 200

    asyncio.run(scenario())
