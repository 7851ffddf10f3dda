"""The control messages of a sync, counted: in the steady state (the third sync of a trainer
into the project's receiver) every call and every answer is as large with 512 tensors as with
64 of the same total size (but for the digits of counts and seconds), on the bucket path
(verified or not) and on the one-copy path (verified or not). A verified bucket sync's `stage`
is sent the digest of what each worker must hold and answers `same` where its fingerprints
digest to it; where they do not it answers every fingerprint, and the sync fails naming the
parameters that differ (docs/benchmarks.md, "Control messages")."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from tests.conftest import free_port
from weightsync import SyncOptions, TrainerSync
from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

TOTAL_BYTES = 1 << 20


class CountingEndpoint(LocalEndpoint):
    """A `LocalEndpoint` that records each call: (method, bytes of its arguments as JSON,
    bytes of its answer as JSON)."""

    def __init__(self, receiver: Any, *, name: str) -> None:
        super().__init__(receiver, name=name)
        self.log: list[tuple[str, int, int]] = []

    def submit(self, method: str, *args: Any) -> Any:
        ticket = super().submit(method, *args)
        status, answer = ticket
        self.log.append(
            (
                method,
                len(json.dumps(list(args))),
                len(json.dumps(answer if status == "ok" else None)),
            )
        )
        return ticket


def _model(num_tensors: int) -> torch.nn.Module:
    size = TOTAL_BYTES // 4 // num_tensors
    return torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(size)) for _ in range(num_tensors)]
    )


class Corrupting(ModuleWeightReceiver):
    """The project's receiver, whose parameter "3" is written wrong at `stage` once `corrupt`
    is set (as a faulty loader would leave it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.params = dict(model.named_parameters())
        self.corrupt = False

    def stage(self, version: str, expect: list[str] | None = None) -> dict:
        if self.corrupt:
            with torch.no_grad():
                self.params["3"][0] += 1.0
        return super().stage(version, expect)


def _steady_messages(num_tensors: int, **options: Any) -> tuple[str, dict[str, list[int]]]:
    """(the path, {method: [calls, argument bytes, answer bytes]}) of a third sync."""
    model = _model(num_tensors)
    sync = TrainerSync(model, options=SyncOptions(bucket_bytes=1 << 18, **options))
    endpoint = CountingEndpoint(ModuleWeightReceiver(_model(num_tensors)), name="engine")
    try:
        sync.connect({"engine": endpoint})
        for step in range(3):
            endpoint.log.clear()
            with torch.no_grad():
                for param in model:
                    param.add_(1.0)
            report = sync.sync(f"v{step}")
    finally:
        sync.close()
    totals: dict[str, list[int]] = {}
    for method, args, answer in endpoint.log:
        row = totals.setdefault(method, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + args, row[2] + answer
    return report.path, totals


@pytest.fixture(scope="module")
def group():
    # The group sets GLOO_SOCKET_IFNAME in this process for the address it meets at: put back
    # as it was, so later tests' processes choose their own.
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    init_trainer_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    yield
    close_trainer_group()
    if before is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = before


@pytest.mark.parametrize(
    ("options", "path"),
    [
        ({"verify": False, "one_copy": False}, "buckets"),
        ({"verify": True, "one_copy": False}, "buckets"),
        ({"verify": False}, "one_copy"),
        ({"verify": True}, "one_copy"),
    ],
    ids=["buckets", "buckets-verified", "one-copy", "one-copy-verified"],
)
def test_a_steady_syncs_control_messages_do_not_grow_with_the_number_of_tensors(
    group, options, path
):
    few = _steady_messages(64, **options)
    many = _steady_messages(512, **options)
    print(f"{path}: 64 tensors {few[1]}, 512 tensors {many[1]}")
    assert few[0] == many[0] == path
    assert set(few[1]) == set(many[1]), (few, many)
    for method, (calls, args, answer) in few[1].items():
        more = many[1][method]
        # the same calls, each as large but for the digits of counts and seconds
        assert more[0] == calls and abs(more[1] - args) <= 8, (method, few, many)
        assert abs(more[2] - answer) <= 16, (method, few, many)


def test_a_verified_bucket_sync_whose_engine_differs_answers_every_fingerprint_and_fails(group):
    """The steady state's `same` answer is only for an engine that holds what the trainer
    sent: one parameter written wrong in the third sync, the engine's digest differs, its
    `stage` answer carries every fingerprint, and the sync fails naming that parameter; the
    syncs before it were answered `same` (this receiver's map of tensors to parameters is
    known from connect, so even the first one was sent its digests)."""
    from weightsync.wire.errors import VerificationFailed

    model = _model(64)
    sync = TrainerSync(
        model, options=SyncOptions(bucket_bytes=1 << 18, verify=True, one_copy=False)
    )
    receiver = Corrupting(_model(64))
    endpoint = CountingEndpoint(receiver, name="engine")
    stages = []
    try:
        sync.connect({"engine": endpoint})
        for step in range(3):
            endpoint.log.clear()
            with torch.no_grad():
                for param in model:
                    param.add_(1.0)
            receiver.corrupt = step == 2
            if step < 2:
                checked = sync.sync(f"v{step}").verify["engine"]
                assert checked.verified and checked.by_digest and checked.num_checked == 64
            else:
                with pytest.raises(VerificationFailed, match="'3'"):
                    sync.sync(f"v{step}")
            stages.append(next(answer for method, _, answer in endpoint.log if method == "stage"))
    finally:
        sync.close()
    print(f"stage answers (bytes): {stages}")
    assert stages[0] < 64 and stages[1] < 64 and stages[2] > 1000, stages
