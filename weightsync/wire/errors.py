"""weightsync's own exceptions, and the one table of errors that cross the wire as themselves.

A call into another process fails in one of two ways. Either the peer refused the caller's input
(a tensor the engine has no parameter for, a bucket whose layout does not fit): the caller has
something to fix, so the error reaches it as the class the peer raised, from `WIRE_ERRORS`. Or
the peer itself failed (a crash, a timeout, a broken invariant): the caller sees RuntimeError.
Every endpoint applies this one table, whatever carries the error: Ray passes the exception
object itself (`crosses_as_itself`); a reply written as plain data (engine workers that must not
raise, the GPU benchmark's pipe) carries `error_to_wire`'s fields and is raised again by
`error_from_wire`. An endpoint in this process (`LocalEndpoint`) passes exceptions unchanged:
nothing crosses.
"""

from __future__ import annotations

import traceback
from typing import Any


class BucketRejected(ValueError):
    """A bucket refused before any of its bytes reached a parameter (bad layout, tensors that
    refit info did not announce): the engine's weights are as they were."""


class NotShared(RuntimeError):
    """The engine's parameters are not (or no longer) in the shared segment the one-copy path
    writes into (weightsync/trainer/one_copy/targets.py)."""


class CollectiveFailed(RuntimeError):
    """A wait of the collective transport (a group forming, a broadcast) failed or ran past its
    deadline; the message names the peer, torch's words and what to check
    (weightsync/transports/collective.py)."""


class EngineBusy(RuntimeError):
    """`begin` refused: another trainer's update is open on the engine (weightsync/engine/
    session.py); it is refused until that update ends or expires."""


class EngineDied(RuntimeError):
    """An engine's process is gone (its Ray actor died): `engine` names it. The trainer drops
    it from later syncs (weightsync/trainer/sender.py)."""

    def __init__(self, message: str, engine: str) -> None:
        super().__init__(message)
        self.engine = engine

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (Ray) with its engine
        return (type(self), (str(self), self.engine))


class VerificationFailed(RuntimeError):
    """An update whose staged weights differ from what the trainer sent: it was aborted
    before any engine adopted it (weightsync/trainer/verify.py). `results`: the verification results
    ({engine: {"verified", "mismatched", ...}})."""

    def __init__(self, message: str, results: dict[str, Any]) -> None:
        super().__init__(message)
        self.results = results

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (Ray: a trainer actor's error) whole
        return (type(self), (str(self), self.results))


class ProbeFailed(RuntimeError):
    """An engine's forward on an update's staged weights scored the probe tokens too far from
    the trainer's (weightsync/wire/probe.py): the engine did not commit the update."""


WIRE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (BucketRejected, ProbeFailed, ValueError, TypeError)
}
"""The errors that reach the caller as themselves (a subclass as the first of these it derives
from, most specific first): the caller's bad input, and an update an engine refused to commit
because its probe failed. Any other failure of a peer reaches the
caller as RuntimeError."""


def wire_class(exc: BaseException) -> type[Exception] | None:
    """The class of `WIRE_ERRORS` that `exc` crosses as, or None (then it crosses as
    RuntimeError)."""
    for cls in WIRE_ERRORS.values():
        if isinstance(exc, cls):
            return cls
    return None


def crosses_as_itself(exc: BaseException) -> bool:
    """Whether an exception object that arrived from a peer (Ray's `as_instanceof_cause`) is
    raised to the caller as it is."""
    return wire_class(exc) is not None


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """`exc` as plain data: {"type": the class it crosses as (its own name when it crosses as
    RuntimeError), "error": its message, "traceback"}."""
    cls = wire_class(exc)
    return {
        "type": cls.__name__ if cls is not None else type(exc).__name__,
        "error": str(exc),
        "traceback": traceback.format_exc(limit=8),
    }


PORTABLE_MODULES = ("builtins", "weightsync.", "ray.")
"""Where the classes of exceptions that any weightsync process can unpickle come from."""


def portable(exc: Exception) -> Exception:
    """`exc` as an actor raises it to a caller in another env: as itself where its class is
    one every weightsync process has (Python's, weightsync's, Ray's); else (an engine's own
    error, whose module exists only in the engine's env: Ray would hand the caller "Failed to
    deserialize exception") a new exception of the class it crosses as (`wire_class`, else
    RuntimeError), whose message names the original class, with the original's notes and the
    last frames of where it was raised."""
    cls = type(exc)
    if cls.__module__ == "builtins" or cls.__module__.startswith(PORTABLE_MODULES[1:]):
        return exc
    plain = (wire_class(exc) or RuntimeError)(f"{cls.__module__}.{cls.__qualname__}: {exc}")
    for note in getattr(exc, "__notes__", ()):
        plain.add_note(note)
    frames = traceback.format_exception(exc, limit=-8)
    plain.add_note("raised at (last frames):\n" + "".join(frames).rstrip())
    return plain


def error_from_wire(error: dict[str, Any], *, peer: str | None = None) -> Exception:
    """The exception to raise for `error_to_wire`'s fields: the table's class with the peer's
    message, else RuntimeError (naming `peer` and the peer's exception type when given)."""
    cls = WIRE_ERRORS.get(error["type"])
    if cls is not None:
        return cls(error["error"])
    if peer is None:
        return RuntimeError(error["error"])
    return RuntimeError(f"{peer} failed: {error['type']}: {error['error']}")
