"""The typed answers above the wire (weightsync/wire/protocol.py): what crosses stays plain data."""

from __future__ import annotations

import json

import pytest

from weightsync.wire.protocol import (
    BeginAnswer,
    EndReport,
    EngineSyncReport,
    EngineVerification,
    LoadReport,
    RefitAnswer,
    SettleReport,
    ShareAnswer,
    SyncReport,
    VerifyReport,
    from_wire,
)

ANSWERS = [
    RefitAnswer(param_of={"w": ["w"], "qkv.q": ["qkv"]}, num_params=2, num_receivers=2, tp_size=2),
    RefitAnswer(param_of={}, num_params=7),
    BeginAnswer(one_copy=True),
    BeginAnswer(one_copy=False, why="vllm: parameters are not shared"),
    ShareAnswer(shared={"segment": "weightsync-1-abc", "nbytes": 4096, "offsets": {"w": 0}}),
    ShareAnswer(shared=[{"segment": "a"}, {"segment": "b"}]),
    ShareAnswer(shared=None, why="not known yet", retry=True),
    LoadReport(num_tensors=3, nbytes=1024, seconds=0.25),
    LoadReport(num_tensors=3, nbytes=1024, seconds=0.25, loader_tensors=2),
    EndReport(weight_version="v1"),
    EndReport(
        weight_version="v2",
        end_s=0.1,
        session_s=0.5,
        cache_flushed=True,
        param_of={"w": ["w"]},
        placements=[{"w": ["w", [[0, 4, 1]]]}, {}],
    ),
    SettleReport(),
    SettleReport(background_s=1.5),
    SyncReport(
        version="v3",
        path="mixed",
        nbytes=10**9,
        num_buckets=4,
        sync_s=0.5,
        engines={
            "a": EngineSyncReport(
                path="buckets",
                weight_version="v3",
                load_s=0.2,
                loader_tensors=12,
                end_s=0.01,
                session_s=0.4,
                cache_flushed=True,
                share_s=0.3,
            ),
            "b": EngineSyncReport(path="one_copy", weight_version="v3"),
        },
        phases_s={"begin": 0.1, "rank_write": [0.1, 0.2]},
        bytes_written=2 * 10**9,
        verify=VerifyReport(
            engines={"a": EngineVerification(verified=True, num_checked=3)}, verify_s=0.05
        ),
    ),
    EngineVerification(verified=False, mismatched=["worker 1: w"], num_checked=4, num_workers=2),
    EngineVerification(verified=None, pending=True),
    VerifyReport(
        engines={
            "a": EngineVerification(verified=True, num_checked=3),
            "b": EngineVerification(verified=None, pending=True),
        },
        verify_s=0.25,
    ),
    SyncReport(version="v1", path="buckets", nbytes=64, num_buckets=1, sync_s=0.0),
]


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_answer_survives_to_dict_json_and_from_dict(answer):
    wired = json.loads(json.dumps(answer.to_dict()))
    assert type(answer).from_dict(wired) == answer


def test_to_dict_carries_the_keys_the_wire_always_carried():
    assert BeginAnswer(one_copy=True).to_dict() == {"one_copy": True}
    assert BeginAnswer(one_copy=False, why="x").to_dict() == {"one_copy": False, "why": "x"}
    assert BeginAnswer(one_copy=False, replays=True).to_dict() == {
        "one_copy": False,
        "replays": True,
    }
    assert ShareAnswer(shared=None, why="x").to_dict() == {
        "shared": None,
        "why": "x",
        "retry": False,
    }
    assert LoadReport(num_tensors=1, nbytes=2, seconds=0.5).to_dict() == {
        "num_tensors": 1,
        "nbytes": 2,
        "seconds": 0.5,
    }
    assert EndReport(weight_version="v", end_s=1.0, session_s=2.0).to_dict() == {
        "weight_version": "v",
        "end_s": 1.0,
        "session_s": 2.0,
    }
    assert SettleReport().to_dict() == {}
    assert SettleReport(background_s=3.0).to_dict() == {"background_s": 3.0}


def test_sync_report_as_plain_data_has_the_keys_users_index():
    report = SyncReport(
        version="v1",
        path="buckets",
        nbytes=2 * 10**9,
        num_buckets=2,
        sync_s=2.0,
        engines={"e": EngineSyncReport(path="buckets", load_s=1.0)},
    )
    assert report.to_dict() == {
        "version": "v1",
        "path": "buckets",
        "nbytes": 2 * 10**9,
        "num_buckets": 2,
        "sync_s": 2.0,
        "gbps": 1.0,
        "engines": {"e": {"status": "ok", "path": "buckets", "load_s": 1.0}},
    }


def test_verify_report_as_plain_data_has_the_keys_users_index():
    report = VerifyReport(
        engines={
            "a": EngineVerification(verified=True, num_checked=3),
            "tp": EngineVerification(
                verified=False, mismatched=["worker 1: w"], num_checked=4, num_workers=2
            ),
            "p": EngineVerification(verified=None, pending=True),
        },
        verify_s=0.05,
    )
    assert report.to_dict() == {
        "a": {"verified": True, "mismatched": [], "num_checked": 3},
        "tp": {
            "verified": False,
            "mismatched": ["worker 1: w"],
            "num_checked": 4,
            "num_workers": 2,
        },
        "p": {"verified": None, "mismatched": [], "num_checked": 0, "pending": True},
        "verify_s": 0.05,
    }
    wired = SyncReport(
        version="v", path="buckets", nbytes=1, num_buckets=1, sync_s=1.0, verify=report
    ).to_dict()
    assert wired["verify"]["tp"]["mismatched"] == ["worker 1: w"]


def _assert_flat_scalars(metrics: dict) -> None:
    """Every value a plain Python int, float or str (no bool, numpy, tensor, None or dict)."""
    odd = {k: type(v).__name__ for k, v in metrics.items() if type(v) not in (int, float, str)}
    assert not odd, odd
    assert all(isinstance(k, str) for k in metrics)


def test_sync_report_metrics_are_one_flat_dict_of_plain_scalars():
    one_copy = SyncReport(
        version="step-2",
        path="one_copy",
        nbytes=4 * 10**9,
        num_buckets=0,
        sync_s=2.0,
        phases_s={"begin": 0.25, "write": 1.5, "end": 0.25, "rank_write": [1.25, 1.5]},
        bytes_written=8 * 10**9,
        engines={
            "vllm": EngineSyncReport(
                path="one_copy", weight_version="step-2", end_s=0.125, session_s=2.0
            ),
            "sgl": EngineSyncReport(
                path="one_copy", weight_version="step-2", end_s=0.5, cache_flushed=True
            ),
        },
        verify=VerifyReport(
            engines={
                "vllm": EngineVerification(verified=True, num_checked=12),
                "sgl": EngineVerification(verified=False, mismatched=["w", "b"], num_checked=12),
            },
            verify_s=0.75,
        ),
    )
    assert one_copy.metrics() == {
        "weightsync/version": "step-2",
        "weightsync/path": "one_copy",
        "weightsync/sync_s": 2.0,
        "weightsync/gbps": 2.0,
        "weightsync/nbytes": 4 * 10**9,
        "weightsync/num_buckets": 0,
        "weightsync/bytes_written": 8 * 10**9,
        "weightsync/phase_begin_s": 0.25,
        "weightsync/phase_write_s": 1.5,
        "weightsync/phase_end_s": 0.25,
        "weightsync/phase_rank_write_max_s": 1.5,
        "weightsync/vllm/one_copy": 1,
        "weightsync/vllm/end_s": 0.125,
        "weightsync/vllm/session_s": 2.0,
        "weightsync/sgl/one_copy": 1,
        "weightsync/sgl/end_s": 0.5,
        "weightsync/sgl/cache_flushed": 1,
        "weightsync/verify_s": 0.75,
        "weightsync/verified": 0,
        "weightsync/vllm/verified": 1,
        "weightsync/vllm/num_checked": 12,
        "weightsync/vllm/num_mismatched": 0,
        "weightsync/vllm/num_unchecked": 0,
        "weightsync/sgl/verified": 0,
        "weightsync/sgl/num_checked": 12,
        "weightsync/sgl/num_mismatched": 2,
        "weightsync/sgl/num_unchecked": 0,
    }
    buckets = SyncReport(
        version="step-1",
        path="buckets",
        nbytes=3 * 10**9,
        num_buckets=3,
        sync_s=1.5,
        engines={
            "vllm": EngineSyncReport(
                path="buckets",
                load_s=1.0,
                loader_tensors=7,
                end_s=0.25,
                cache_flushed=False,
                share_s=0.5,
            )
        },
    )
    assert buckets.metrics(prefix="refit/") == {
        "refit/version": "step-1",
        "refit/path": "buckets",
        "refit/sync_s": 1.5,
        "refit/gbps": 3 * 10**9 / 1.5 / 1e9,
        "refit/nbytes": 3 * 10**9,
        "refit/num_buckets": 3,
        "refit/vllm/one_copy": 0,
        "refit/vllm/load_s": 1.0,
        "refit/vllm/loader_tensors": 7,
        "refit/vllm/end_s": 0.25,
        "refit/vllm/cache_flushed": 0,
        "refit/vllm/share_s": 0.5,
    }
    for answer in [one_copy, buckets, *ANSWERS]:
        if isinstance(answer, SyncReport | VerifyReport):
            _assert_flat_scalars(answer.metrics())
            # What crossed between envs as plain data gives the same metrics.
            wired = type(answer).from_dict(json.loads(json.dumps(answer.to_dict())))
            assert wired.metrics() == answer.metrics()


def test_sync_report_metrics_are_plain_python_numbers_whatever_the_fields_held():
    import numpy as np

    report = SyncReport(
        version="v",
        path="buckets",
        nbytes=np.int64(10**9),  # type: ignore[arg-type]
        num_buckets=np.int64(1),  # type: ignore[arg-type]
        sync_s=np.float32(0.5),  # type: ignore[arg-type]
        engines={
            "e": EngineSyncReport(path="buckets", load_s=np.float64(0.25), cache_flushed=True)
        },
        verify=VerifyReport(engines={"e": EngineVerification(verified=True, num_checked=1)}),
    )
    metrics = report.metrics()
    _assert_flat_scalars(metrics)
    assert metrics["weightsync/gbps"] == 2.0 and metrics["weightsync/e/cache_flushed"] == 1
    assert metrics["weightsync/verified"] == 1 and metrics["weightsync/verify_s"] == 0.0


def test_verify_report_metrics_for_sync_verify_under_a_prefix_of_their_own():
    report = VerifyReport(
        engines={
            "a": EngineVerification(verified=True, num_checked=3),
            "tp": EngineVerification(
                verified=False, mismatched=["worker 1: w"], num_checked=4, num_workers=2
            ),
            "p": EngineVerification(verified=None, pending=True),
        },
        verify_s=0.5,
    )
    assert report.metrics("weightsync/check/") == {
        "weightsync/check/verify_s": 0.5,
        "weightsync/check/verified": 0,
        "weightsync/check/a/verified": 1,
        "weightsync/check/a/num_checked": 3,
        "weightsync/check/a/num_mismatched": 0,
        "weightsync/check/a/num_unchecked": 0,
        "weightsync/check/tp/verified": 0,
        "weightsync/check/tp/num_checked": 4,
        "weightsync/check/tp/num_mismatched": 1,
        "weightsync/check/tp/num_unchecked": 0,
        "weightsync/check/p/verified": 0,  # pending: not verified (yet)
        "weightsync/check/p/num_checked": 0,
        "weightsync/check/p/num_mismatched": 0,
        "weightsync/check/p/num_unchecked": 0,
    }
    assert VerifyReport().metrics() == {"weightsync/verify_s": 0.0, "weightsync/verified": 0}


def test_verify_report_reads_each_engine_by_name_and_says_which_were_verified():
    report = VerifyReport(
        engines={
            "a": EngineVerification(verified=True, num_checked=3),
            "p": EngineVerification(verified=None, pending=True),
        },
        verify_s=0.5,
    )
    assert report["a"].verified and "a" in report and "x" not in report
    assert report.pending == ["p"] and not report.verified
    with pytest.raises(KeyError, match=r"engine 'x' was not verified; verified: \['a', 'p'\]"):
        report["x"]
    again = VerifyReport(engines={"p": EngineVerification(verified=True, num_checked=2)})
    merged = report.merged(again)
    assert merged.verified and merged.pending == [] and merged.verify_s == 0.5


def test_from_dict_fills_absent_optional_fields_and_ignores_unknown_keys():
    answer = RefitAnswer.from_dict({"param_of": {"w": ["w"]}, "num_params": 1, "tp_rank": 0})
    assert (answer.num_receivers, answer.tp_size) == (1, 1)
    assert ShareAnswer.from_dict({"shared": None}) == ShareAnswer(shared=None)
    assert EndReport.from_dict({"weight_version": "v"}).cache_flushed is None


@pytest.mark.parametrize(
    "cls, d, missing",
    [
        (RefitAnswer, {"param_of": {}}, "num_params"),
        (BeginAnswer, {"why": "x"}, "one_copy"),
        (ShareAnswer, {"why": "x", "retry": True}, "shared"),
        (LoadReport, {"num_tensors": 1, "seconds": 0.1}, "nbytes"),
        (EndReport, {"end_s": 0.1}, "weight_version"),
        (EngineSyncReport, {"status": "ok"}, "path"),
        (SyncReport, {"version": "v", "path": "buckets", "nbytes": 1, "num_buckets": 1}, "sync_s"),
        (EngineVerification, {"mismatched": [], "num_checked": 1}, "verified"),
        (VerifyReport, {"a": {"verified": True, "mismatched": [], "num_checked": 1}}, "verify_s"),
    ],
)
def test_from_dict_without_a_required_field_names_it(cls, d, missing):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: required field '{missing}' missing"):
        cls.from_dict(d)


def test_from_dict_of_something_else_than_a_dict_says_what_it_got():
    with pytest.raises(ValueError, match="LoadReport: expected a dict, got NoneType"):
        LoadReport.from_dict(None)


def test_from_wire_types_the_answers_of_the_receiver_methods_only():
    assert from_wire("begin", {"one_copy": True}) == BeginAnswer(one_copy=True)
    prints = {"w": [1, 2]}
    assert from_wire("fingerprints", prints) is prints


def test_an_end_answer_leaves_out_the_maps_the_sender_holds_whole():
    """`end(known=...)`: placements and the tensor -> parameter map the sender holds at their
    size are not sent back (both only grow); a map of another size is."""
    from weightsync.wire.protocol import EndReport, known_maps, without_known

    param_of = {"a": ["a"], "b": ["b"]}
    placements = [{"a": {}}, {"a": {}, "b": {}}]
    report = EndReport(weight_version="v", param_of=param_of, placements=placements)
    known = known_maps(placements, param_of)
    assert known == {"placements": [1, 2], "param_of": 2}
    bare = without_known(report, known)
    assert bare.param_of is None and bare.placements is None and bare.weight_version == "v"
    grown = without_known(report, known_maps(placements, {"a": ["a"]}))
    assert grown.param_of == param_of and grown.placements is None
    assert without_known(report, {}) == report
    assert known_maps(None) == {}


def test_an_engines_refit_answer_from_its_workers_names_each_ones_accepted_forms_by_rank():
    """backends' `check_refit` at TP > 1: the first worker's answer, with how many a sync
    reaches, the TP size and every worker's accepted forms named by rank."""
    from weightsync.engine.refit import combine_refit_answers
    from weightsync.wire.protocol import RefitAnswer

    answers = [
        RefitAnswer(param_of={"w": ["w"]}, num_params=1).to_dict(),
        {**RefitAnswer(param_of={"w": ["w"]}, num_params=1).to_dict(), "accepted": ["a (ok)"]},
    ]
    combined = RefitAnswer.from_dict(combine_refit_answers(answers, who="worker", tp_size=2))
    assert (combined.num_receivers, combined.tp_size) == (2, 2)
    assert combined.accepted == ["worker 1: a (ok)"] and combined.param_of == {"w": ["w"]}
    plain = combine_refit_answers(answers[:1], who="scheduler", tp_size=1)
    assert RefitAnswer.from_dict(plain).accepted is None
