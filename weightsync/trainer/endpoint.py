"""Endpoints: how the sender reaches a `WeightReceiver` (an engine actor, or one in-process).

The sender submits calls and waits for them with a deadline, so a dead engine surfaces as a
RuntimeError naming it instead of a hang. Arguments and results are plain data; which of the
engine's errors reach the caller as themselves is weightsync/wire/errors.py's `WIRE_ERRORS`.
`EngineCalls` is the sender's registered engines and its calls to them, one or all at once; every
answer becomes its weightsync/wire/protocol.py class where it arrives (`wait_all`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from weightsync.wire.errors import EngineDied, crosses_as_itself
from weightsync.wire.protocol import from_wire

logger = logging.getLogger(__name__)


class Endpoint(ABC):
    """A receiver the sender can call asynchronously. Used by the sending rank only."""

    name: str

    @abstractmethod
    def submit(self, method: str, *args: Any) -> Any:
        """Start `method(*args)` on the receiver; returns a ticket for `wait`."""

    @abstractmethod
    def wait(self, ticket: Any, *, timeout_s: float) -> Any:
        """The call's result. Raises RuntimeError naming the endpoint if it failed or timed
        out, and the receiver's own error of `WIRE_ERRORS` when it rejected the input."""

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        return self.wait(self.submit(method, *args), timeout_s=timeout_s)


class LocalEndpoint(Endpoint):
    """A receiver object in this process; calls run at submit time, and its exceptions are
    raised unchanged (nothing crosses a wire). A call that runs while the trainer's ranks
    send (`p2p_receive`, `CONCURRENT`) runs on a thread of its own, started at submit."""

    CONCURRENT = frozenset({"p2p_receive"})

    def __init__(self, receiver: Any, *, name: str = "local") -> None:
        self.receiver = receiver
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, method: str, *args: Any) -> Any:
        if method in self.CONCURRENT:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"weightsync-{self.name}")
            return ("future", self._pool.submit(getattr(self.receiver, method), *args))
        try:
            return ("ok", getattr(self.receiver, method)(*args))
        except Exception as exc:  # delivered at wait(), like a remote failure
            return ("error", exc)

    def wait(self, ticket: Any, *, timeout_s: float) -> Any:
        status, value = ticket
        if status == "future":
            try:
                return value.result(timeout=timeout_s)
            except FutureTimeout:
                raise RuntimeError(
                    f"engine {self.name!r} did not answer within {timeout_s:.0f} s"
                ) from None
        if status == "error":
            raise value
        return value


class RayEndpoint(Endpoint):
    """A Ray actor implementing `WeightReceiver`; or, with `dispatch`, a framework's own actor
    holding one (e.g. `VllmEngineActor(llm=its_llm)`) whose method `dispatch(method, *args)`
    returns `getattr(receiver, method)(*args)`."""

    def __init__(self, actor: Any, *, name: str, dispatch: str | None = None) -> None:
        self.actor = actor
        self.name = name
        self.dispatch = dispatch

    def submit(self, method: str, *args: Any) -> Any:
        if self.dispatch is not None:
            return getattr(self.actor, self.dispatch).remote(method, *args)
        return getattr(self.actor, method).remote(*args)

    def wait(self, ticket: Any, *, timeout_s: float) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ticket, timeout=timeout_s)
        except GetTimeoutError:
            ray.cancel(ticket, force=False)
            raise RuntimeError(
                f"engine {self.name!r} did not answer within {timeout_s:.0f} s; is it alive?"
            ) from None
        except RayActorError as exc:
            raise EngineDied(f"engine {self.name!r} died: {exc}", self.name) from None
        except RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if crosses_as_itself(cause):
                raise cause from None
            raise RuntimeError(f"engine {self.name!r} failed: {exc}") from None


@dataclass(kw_only=True, slots=True)
class EngineState:
    """An engine the sender registered: how to reach it, and what it reported of its parameters
    (what verification compares against)."""

    endpoint: Endpoint
    param_of: dict[str, list[str]] = field(default_factory=dict)
    # Per worker, {tensor: [parameter, patterns]}: where its loader puts the elements of each
    # tensor it holds (weightsync/wire/placement.py); None for a receiver that reports none.
    placements: list[dict[str, Any]] | None = None
    # Why its weights cannot be read back (a stock engine's `RefitAnswer.unverifiable`).
    unverifiable: str | None = None


# A call submitted to an engine: (engine, method, the endpoint's ticket).
Call = tuple[str, str, Any]


class EngineCalls:
    """The sender's registered engines by name, and its calls to them, each bounded by
    `timeout_s` unless told otherwise. Used by the sending rank only."""

    def __init__(self, engines: dict[str, EngineState], *, timeout_s: float) -> None:
        self.engines = engines
        self.timeout_s = timeout_s
        # Engines whose process is gone (`EngineDied`), and why: later syncs leave them out.
        self.dead: dict[str, str] = {}

    def submit(self, name: str, method: str, *args: Any) -> Call:
        return name, method, self.engines[name].endpoint.submit(method, *args)

    def wait_all(self, calls: list[Call], *, timeout_s: float | None = None) -> list[Any]:
        """The answers to `submit`'s calls, in order, each turned into its
        weightsync/wire/protocol.py class as it comes off the wire."""
        answers = []
        for name, method, ticket in calls:
            try:
                answer = self.engines[name].endpoint.wait(
                    ticket, timeout_s=timeout_s or self.timeout_s
                )
            except EngineDied as exc:
                self.dead[exc.engine] = str(exc).splitlines()[0][:300]
                raise
            answers.append(from_wire(method, answer))
        return answers

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self.wait_all([self.submit(name, method, *args)], timeout_s=timeout_s)[0]

    def call_all(self, method: str, *args: Any, names: list[str]) -> list[Any]:
        """`method(*args)` on every engine of `names` at once; their answers, in order."""
        return self.wait_all([self.submit(n, method, *args) for n in names])

    def abort(self, names: list[str], reason: str, owner: str | None = None) -> None:
        """Abort the session on each engine of `names`, going on past any that fails; `owner`:
        the sender's name, so an engine whose open update is another trainer's keeps it."""
        for name in names:
            if name in self.dead:
                continue  # nothing is left to abort
            endpoint = self.engines[name].endpoint
            try:
                endpoint.call("abort", reason, owner, timeout_s=min(self.timeout_s, 10.0))
            except Exception as exc:  # the engine may be the thing that failed
                logger.warning("abort on engine %r failed too: %s", name, exc)
