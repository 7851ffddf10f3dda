"""The one table of errors that cross the wire: the caller's bad input as itself, anything else
as RuntimeError, the same whichever endpoint carried it."""

from __future__ import annotations

import json

import pytest

from weightsync.wire.errors import (
    WIRE_ERRORS,
    BucketRejected,
    NotShared,
    ProbeFailed,
    crosses_as_itself,
    error_from_wire,
    error_to_wire,
)
from weightsync.wire.specs import error_reply, ok_reply, unwrap_all


def _over_the_wire(exc: BaseException) -> dict:
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - as an engine worker catches it
        return json.loads(json.dumps(error_reply(raised)))


def test_the_callers_bad_input_crosses_as_itself():
    assert list(WIRE_ERRORS) == ["BucketRejected", "ProbeFailed", "ValueError", "TypeError"]
    for exc in (
        BucketRejected("bucket 3: bad layout"),
        ProbeFailed("vllm: update 'v1' failed the log-prob probe"),
        ValueError("tensor 'w': shape"),
        TypeError("not a dict"),
    ):
        with pytest.raises(type(exc), match=str(exc)) as info:
            unwrap_all([_over_the_wire(exc)])
        assert type(info.value) is type(exc)
        assert crosses_as_itself(exc)


def test_a_subclass_crosses_as_the_table_class_it_derives_from():
    reply = _over_the_wire(json.JSONDecodeError("bad json", "{", 0))
    assert reply["type"] == "ValueError"
    with pytest.raises(ValueError, match="bad json"):
        unwrap_all([reply])


def test_a_failed_peer_crosses_as_runtime_error():
    for exc in (NotShared("parameters moved"), KeyError("w"), RuntimeError("boom")):
        assert not crosses_as_itself(exc)
        with pytest.raises(RuntimeError) as info:
            unwrap_all([_over_the_wire(exc)])
        assert type(info.value) is RuntimeError


def test_a_named_peer_is_named_with_the_error_it_raised():
    error = error_to_wire(NotShared("parameters moved"))
    assert (
        str(error_from_wire(error, peer="receiver"))
        == "receiver failed: NotShared: parameters moved"
    )
    assert str(error_from_wire(error)) == "parameters moved"


def test_the_first_failed_reply_is_raised_and_otherwise_every_result_returned():
    assert unwrap_all([ok_reply({"a": 1}), ok_reply({"a": 2})]) == [{"a": 1}, {"a": 2}]
    with pytest.raises(ValueError, match="second") as info:
        unwrap_all([ok_reply(1), _over_the_wire(ValueError("second"))])
    assert "from engine worker 1 of 2" in info.value.__notes__


def test_one_workers_refusal_after_another_worker_did_the_call_is_no_longer_a_rejection():
    """`BucketRejected` promises the weights are as they were. One tensor-parallel worker's
    refusal while another wrote its part breaks that promise for the engine: it crosses as a
    RuntimeError naming both, so the engine counts the call as one that may have written
    (rolled back, or not served)."""
    refused = _over_the_wire(BucketRejected("the point-to-point receive failed before writing"))
    with pytest.raises(BucketRejected):
        unwrap_all([refused, refused])  # every worker refused: nothing written anywhere
    with pytest.raises(RuntimeError) as info:
        unwrap_all([ok_reply({"num_tensors": 3}), refused])
    assert type(info.value) is RuntimeError
    assert str(info.value) == (
        "engine worker 1 of 2 refused before writing (the point-to-point receive failed before "
        "writing), but worker(s) [0] did the call: the engine's weights may be partly written"
    )


def test_errors_with_fields_survive_pickling_as_a_trainer_actors_error_does():
    """Ray pickles an actor's exception to its caller: one whose constructor takes more than the
    message must come back whole (else the caller gets Ray's "failed to deserialize")."""
    import pickle

    from weightsync.wire.errors import EngineDied, VerificationFailed

    failed = pickle.loads(
        pickle.dumps(VerificationFailed("v1 aborted", {"e": {"verified": False}}))
    )
    assert isinstance(failed, VerificationFailed) and str(failed) == "v1 aborted"
    assert failed.results == {"e": {"verified": False}}
    died = pickle.loads(pickle.dumps(EngineDied("engine 'e' died", "e")))
    assert isinstance(died, EngineDied) and died.engine == "e" and str(died) == "engine 'e' died"


def test_an_error_rank_0_broadcasts_to_the_other_ranks_keeps_its_start_and_its_end():
    """A remote error's message comes after its traceback: cut to fit, the other ranks' error
    still ends with it."""
    from weightsync.trainer.sync import _cut

    text = "RayTaskError(ProbeFailed): Traceback\n" + "  frame\n" * 1000 + "ProbeFailed: too far"
    cut = _cut(text)
    assert len(cut) < 2100, len(cut)
    assert cut.startswith("RayTaskError(ProbeFailed): Traceback") and cut.endswith("too far")
    assert f"({len(text) - 2000} characters left out)" in cut
    assert _cut("short") == "short"
