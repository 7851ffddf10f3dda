"""Endpoints: how the sender reaches a `WeightReceiver` (an engine actor, or one in-process).

The sender submits calls and waits for them with a deadline, so a dead engine surfaces as a
RuntimeError naming it instead of a hang. Arguments and results are plain data; which of the
engine's errors reach the caller as themselves is weightsync/errors.py's `WIRE_ERRORS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from weightsync.errors import crosses_as_itself


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
    raised unchanged (nothing crosses a wire)."""

    def __init__(self, receiver: Any, *, name: str = "local") -> None:
        self.receiver = receiver
        self.name = name

    def submit(self, method: str, *args: Any) -> Any:
        try:
            return ("ok", getattr(self.receiver, method)(*args))
        except Exception as exc:  # delivered at wait(), like a remote failure
            return ("error", exc)

    def wait(self, ticket: Any, *, timeout_s: float) -> Any:
        status, value = ticket
        if status == "error":
            raise value
        return value


class RayEndpoint(Endpoint):
    """A Ray actor implementing `WeightReceiver`."""

    def __init__(self, actor: Any, *, name: str) -> None:
        self.actor = actor
        self.name = name

    def submit(self, method: str, *args: Any) -> Any:
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
            raise RuntimeError(f"engine {self.name!r} died: {exc}") from None
        except RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if crosses_as_itself(cause):
                raise cause from None
            raise RuntimeError(f"engine {self.name!r} failed: {exc}") from None
