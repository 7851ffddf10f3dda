"""A staged sync's switches into several engines, all or none.

Each engine switches to its staged copy at its own `end` (weightsync/engine/session.py). When
one of them fails (its switch, or its probe after the switch), those that switched would serve
the new version beside engines serving the previous one: each is switched back (`revert`,
possible where the engines keep the previous weights: `SyncOptions.keep_previous`), and the
error says what every engine serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync.wire.errors import ProbeFailed

if TYPE_CHECKING:
    from weightsync.trainer.endpoint import Call, EngineCalls
    from weightsync.wire.protocol import EndReport


def _line(exc: BaseException) -> str:
    """An error's own message: the last line of a remote error (its traceback comes first)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def end_all_or_none(calls: EngineCalls, ends: list[Call], version: str) -> list[EndReport]:
    """Every `end` of `ends` answered, in order; where any failed, every engine whose `end`
    succeeded is switched back to its previous weights and version, and RuntimeError says
    what each engine serves (`ProbeFailed` where the first failure was a probe's)."""
    answers: dict[str, EndReport] = {}
    failed: dict[str, BaseException] = {}
    for call in ends:  # every answer: one engine's failure must not hide another's switch
        try:
            answers[call[0]] = calls.wait_all([call])[0]
        except Exception as exc:  # noqa: BLE001 - reported together below
            failed[call[0]] = exc
    if not failed:
        return [answers[call[0]] for call in ends]
    serves: dict[str, str] = {name: f"failed: {_line(exc)}" for name, exc in failed.items()}
    for name in answers:
        try:
            back = calls.call(name, "revert")
            serves[name] = f"switched back to {back.weight_version or 'its start-up weights'!r}"
        except Exception as exc:  # noqa: BLE001 - said in the error
            serves[name] = f"serves {version!r}: it could not be switched back ({_line(exc)})"
    every = all(text.startswith(("failed", "switched back")) for text in serves.values())
    first = next(iter(failed.values()))
    kind = ProbeFailed if isinstance(first, ProbeFailed) else RuntimeError
    raise kind(
        f"staged update {version!r}: {len(failed)} of {len(ends)} engine(s) failed at the "
        f"switch ({sorted(failed)}); "
        + (
            "every engine that switched was switched back, all or none"
            if every
            else "not every engine that switched could be switched back (keep_previous=True "
            "keeps what a switch replaces)"
        )
        + f": {serves}"
    ) from first
