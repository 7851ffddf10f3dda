from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

# Every actor's lines as it wrote them (read when ray is imported, so before any test module
# imports it): by default Ray folds lines alike across actors into one, which leaves the ranks'
# hang reports (weightsync/driver/hang_report.py) in pieces.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Suites whose every test runs a real engine (each suite runs in the env it needs).
ENGINE_SUITES = {"sglang", "vllm", "e2e", "reliability"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`engine` on every test of an engine suite; `gpu` tests skipped where CUDA is absent."""
    cuda: bool | None = None
    for item in items:
        if Path(str(item.path)).parent.name in ENGINE_SUITES:
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


_stacks_taken: list[str] = []  # the suites of the failures whose engine stacks were taken


# A test that passes after this long says what it printed last (how far each step came).
SLOW_S = 300.0


def _own_lines(report: pytest.TestReport, count: int) -> list[str]:
    """The test's own last printed lines (not its actors', which Ray prefixes)."""
    return [
        line
        for name, text in report.sections
        if name.startswith("Captured stdout")
        for line in text.splitlines()
        if line.strip() and not line.startswith(("(", "\x1b["))
    ][-count:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failed test's reason and its actors' hang reports, and a slow test's last lines,
    appended to the file `WEIGHTSYNC_FAILURE_LOG` names (scripts/test.sh prints it after the
    suites)."""
    path = os.environ.get("WEIGHTSYNC_FAILURE_LOG")
    if path and report.passed and report.when == "call" and report.duration > SLOW_S:
        own = "\n".join(ln[:200] for ln in _own_lines(report, 4))
        with open(path, "a") as out:
            out.write(f"{report.nodeid} passed in {report.duration:.0f} s; its last lines:\n")
            out.write(f"{own}\n")
    if not path or not report.failed:
        return
    from tests.failure_log import hang_reports, process_stacks
    from weightsync.driver.hang_report import MARK as HANG_MARK

    crash = getattr(report.longrepr, "reprcrash", None)
    lines = crash.message.splitlines() if crash and crash.message else [""]
    reason = lines[0][:600]
    # what the error says below its first line: a timed-out group call's view of its ranks
    more = "\n".join(lines[1:])
    more = more if len(more) <= 3000 else more[:2980] + "\n... (cut)"
    captured = "\n".join(text for name, text in report.sections if name.startswith("Captured"))
    engines = ""
    suite = Path(str(report.fspath)).parent.name
    if report.when == "call" and suite in ENGINE_SUITES and _stacks_taken.count(suite) < 2:
        _stacks_taken.append(suite)  # a broken suite's every failure would take a minute
        engines = process_stacks(limit=1500)  # the engines the test leaves, as they are now
    stacks = hang_reports(captured, limit=2500)
    own = _own_lines(report, 6)  # how far it came
    # Most telling first: a log's tail is read from a fixed length before its end.
    with open(path, "a") as out:
        out.write(f"{report.nodeid} ({report.when}): {reason}\n")
        if more.strip():
            out.write(f"{more}\n")
        if own:
            out.write("the test's last lines:\n" + "\n".join(ln[:200] for ln in own) + "\n")
        if stacks:
            out.write(f"hang reports of the test's actors:\n{stacks}\n")
        elif HANG_MARK in reason:
            out.write("no hang report in the test's output (none of its actors wrote one)\n")
        if engines:
            out.write(f"engine processes after the failure:\n{engines}\n")


logging.getLogger("weightsync").setLevel(logging.INFO)
