"""The control messages of a sync, counted: in the steady state (the third sync of a trainer
into the project's receiver) every call and every answer is as large with 512 tensors as with
64 of the same total size (but for the digits of counts and seconds), on the bucket path (unverified) and on the one-copy path (verified
or not). The verified bucket path's `stage` answer is not: it carries one fingerprint per
parameter (docs/benchmarks.md, "Control messages")."""

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
        ({"verify": False}, "one_copy"),
        ({"verify": True}, "one_copy"),
    ],
    ids=["buckets", "one-copy", "one-copy-verified"],
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


def test_a_verified_bucket_syncs_stage_answer_grows_with_the_parameters_it_fingerprints(group):
    """What is not constant yet, so that the row in docs/benchmarks.md stays true."""
    few = _steady_messages(64, verify=True, one_copy=False)[1]
    many = _steady_messages(512, verify=True, one_copy=False)[1]
    assert many["stage"][2] > 6 * few["stage"][2], (few, many)
    assert {m: r[0] for m, r in few.items()} == {m: r[0] for m, r in many.items()}
