"""A trainer group call that outlasts its timeout: before the driver's TimeoutError, each rank
still in it writes where its threads are to its output, which Ray brings to the driver: a rank
waiting in a system call names its native and Python frames (py-spy), a rank whose interpreter
lock is held names its Python frames all the same (faulthandler). Real Ray actors."""

from __future__ import annotations

import re
import time

import pytest
import ray

from tests.failure_log import hang_reports
from weightsync.driver import launcher
from weightsync.driver.hang_report import MARK, HangReport, py_spy

QUALNAME = "tests.core.test_hang_report.StuckRank"


class StuckRank:
    """A trainer rank whose `stuck` never ends: rank 0 sleeps, rank 1 holds the interpreter."""

    def __init__(self, *, rank: int, **_: object) -> None:
        self.rank = rank

    def stuck(self) -> None:
        if self.rank == 0:
            _waits_in_here()
        _holds_the_interpreter()

    def ping(self) -> int:
        return self.rank


def _waits_in_here() -> None:
    time.sleep(600)


def _holds_the_interpreter() -> None:
    # Exponential backtracking inside the regex engine's C code, which keeps the GIL.
    re.match(r"(a*)*b", "a" * 64)


@pytest.fixture(scope="module")
def ray_job():
    launcher.init_ray(num_cpus=2)
    launcher.register_actor(QUALNAME, "driver")
    yield
    ray.shutdown()


def test_a_group_call_past_its_timeout_reports_where_each_rank_is(ray_job, capfd):
    assert py_spy() is not None, "py-spy is in the dev group: the native report needs it"
    # Each rank reports 5 s before the timeout (`_report_lead_s`); the driver reads it after.
    group = launcher.TrainerGroup(QUALNAME, world_size=2, call_timeout_s=20)
    try:
        ranks = [ray.get(r.handle.where.remote(), timeout=60)["pid"] for r in group.ranks]
        with pytest.raises(TimeoutError) as raised:
            group.call("stuck")
        message = str(raised.value)
        assert MARK in message, message
        # and the driver read both ranks from outside: rank 1's held lock does not stop py-spy
        read = message.split("as the driver read it: ")
        assert len(read) == 3 and all(part.startswith("in the call") for part in read[1:]), message
        assert "_waits_in_here" in read[1] and "_holds_the_interpreter" in read[2], message
        seen = ""
        deadline = time.monotonic() + 90  # py-spy may take its 30 s under load
        while time.monotonic() < deadline:  # Ray brings an actor's output within seconds
            time.sleep(1)
            out, err = capfd.readouterr()
            seen += out + err
            reports = hang_reports(seen, limit=100_000)
            # rank 0's native frames come last (py-spy takes seconds), rank 1's Python ones
            if "clock_nanosleep" in reports and "_holds_the_interpreter" in reports:
                break
    finally:
        group.kill()
    print(reports)
    # Each rank writes faulthandler's Python frames, then py-spy's report: in either order here.
    blocks: dict[str, list[str]] = {}
    for block in reports.split("-- "):
        if block:
            blocks.setdefault(block.split("\n", 1)[0], []).append(block)
    sleeper = next((b for b in blocks.get(f"pid {ranks[0]}", []) if MARK in b), "")
    holder = next((b for b in blocks.get(f"pid {ranks[1]}", []) if "\nTimeout (" in b), "")
    # rank 0: py-spy's report, its main thread in the sleep it waits in (native and Python)
    assert sleeper and MARK in sleeper and "StuckRank.stuck()" in sleeper, reports
    assert "_waits_in_here" in sleeper and "clock_nanosleep" in sleeper, sleeper
    # and every thread by name and state, the native ones too (Ray's own, here)
    threads = sleeper.split("threads: ", 1)[1].split("\n", 1)[0]
    assert "hrtimer_nanosleep" in threads or "clock_nanosleep" in threads, threads
    assert len(threads.split("; ")) > 3, threads
    # rank 1: py-spy could not start (that needs the interpreter); faulthandler's frames came
    assert holder.split("\n")[1].startswith("Timeout ("), holder
    assert "_holds_the_interpreter" in holder and "in stuck" in holder, holder


def test_a_call_that_never_started_is_read_by_the_driver_where_the_rank_still_is(ray_job):
    """A rank whose main thread is still in what ran before (here a method called on the
    actor directly, past the group) never starts the group's call, so writes no report; the
    driver's TimeoutError says so and names the frames the rank is in."""
    group = launcher.TrainerGroup(QUALNAME, world_size=2, call_timeout_s=8)
    try:
        assert group.call("ping") == 0
        for rank in group.ranks:
            rank.stuck.remote()
        with pytest.raises(TimeoutError) as raised:
            group.call("ping")
    finally:
        group.kill()
    message = str(raised.value)
    read = message.split("as the driver read it: ")
    assert len(read) == 3, message
    assert all(part.startswith("not in the call: it never started") for part in read[1:]), message
    assert "_waits_in_here" in read[1] and "clock_nanosleep" in read[1], message
    assert "_holds_the_interpreter" in read[2] and "call_within" not in message, message


def test_a_block_that_ends_in_time_reports_nothing(capfd):
    with HangReport(2.0, "quick"):
        time.sleep(0.1)
    time.sleep(3)
    out, err = capfd.readouterr()
    assert "Timeout (" not in out + err and MARK not in out + err


def test_the_native_report_is_one_piece_whatever_else_writes_beside_it(capfd):
    """The native report (its header, thread states and py-spy's frames) is written in one
    piece once py-spy is done, so what other threads write meanwhile (faulthandler's report,
    started at the same moment) comes before or after it, never between its lines, and a
    reader of the output finds it whole."""
    import sys
    import threading

    stop = threading.Event()

    def noise() -> None:
        while not stop.wait(0.05):
            print("noise", file=sys.stderr, flush=True)

    writer = threading.Thread(target=noise, daemon=True)
    writer.start()
    text = ""
    try:
        with HangReport(1.0, "slow"):
            deadline = time.monotonic() + 60  # py-spy may take its 30 s under load
            while "native frames:" not in text and time.monotonic() < deadline:
                time.sleep(1)
                out, err = capfd.readouterr()
                text += out + err
    finally:
        stop.set()
        writer.join()
    assert MARK in text, text
    native = text[text.index(MARK) :].split("noise\n", 1)[0]
    assert "its threads' native frames:" in native and "time_sleep" in native, text
