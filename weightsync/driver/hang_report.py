"""Where a process is, written to its stderr when a call outlasts its time.

A call that never returns leaves its caller with a timeout and no account of why. `HangReport`
arms two reports for a call that may hang: every thread's Python frames, written by
`faulthandler` from its own C thread (so a process whose interpreter lock is held still
reports), and, where py-spy is installed, every thread's native frames (the lock or the system
call a thread waits in), after a count of all its threads by name and state (native threads,
such as a collective library's, which py-spy does not show, among them). In a Ray actor stderr is the actor's output, which Ray shows to the
driver with the actor's pid in front of each line.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

# The first line of each report (faulthandler's own starts "Timeout (h:mm:ss)!").
MARK = "weightsync hang report"
# py-spy's and faulthandler's thread headers
_THREAD = re.compile(r"^(Current thread|Thread) \S+ ")
# A faulthandler frame's file, to its last three parts.
_PATH = re.compile(r'File "[^"]*?(?P<tail>([^/"]+/){0,2}[^/"]+")')


def py_spy() -> str | None:
    """py-spy next to this interpreter (an env's bin folder) or on PATH, or None."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def native_stacks(pid: int, *, timeout_s: float = 30.0) -> str:
    """py-spy's dump of every thread of `pid`, native frames included, or why there is none.
    A dump that fails (a process is traced by one reader at a time: another py-spy may hold
    it) is tried again while `timeout_s` lasts."""
    import time

    spy = py_spy()
    if spy is None:
        return "no native frames: py-spy is not installed next to this interpreter or on PATH"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done = subprocess.run(
                [spy, "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except subprocess.TimeoutExpired:
            return f"no native frames: py-spy did not answer within {timeout_s:g} s"
        out = (done.stdout + done.stderr).strip()
        if (
            done.returncode == 0
            or time.monotonic() + 2 > deadline
            or not os.path.exists(f"/proc/{pid}")
        ):
            return out
        time.sleep(1)


def thread_states(pid: int) -> str:
    """Every thread of `pid` (native ones too, which py-spy leaves out), counted by name,
    state and the kernel function it sleeps in (/proc: "3 x pt_gloo_runloop S futex_wait_queue"),
    or why there is no such count."""
    counts: dict[tuple[str, str, str], int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError as exc:
        return f"no thread states: {exc}"
    for tid in tasks:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{base}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            continue  # the thread ended meanwhile
        key = (name, state, wchan)
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(
        f"{n} x {name} {state} {wchan}" for (name, state, wchan), n in sorted(counts.items())
    )


class HangReport:
    """`with HangReport(seconds, what):` a block still running `seconds` later gets its
    process's threads written to stderr: Python frames at `seconds`, native ones (py-spy)
    right after. Leaving the block cancels both. One at a time per process (faulthandler
    keeps a single timer)."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self._timer: threading.Timer | None = None

    def __enter__(self) -> HangReport:
        if self.seconds > 0:
            try:
                faulthandler.dump_traceback_later(self.seconds, repeat=False, file=sys.stderr)
            except (AttributeError, ValueError, OSError):  # a stderr with no file behind it
                pass  # the native report alone
            self._timer = threading.Timer(self.seconds, self._native)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            faulthandler.cancel_dump_traceback_later()
            self._timer.cancel()
            self._timer = None

    def _native(self) -> None:
        pid = os.getpid()
        head = f"{MARK}: {self.what} still running after {self.seconds:g} s in pid {pid}"
        states = thread_states(pid)  # as they are now, before py-spy stops the process
        # One write, once py-spy is done: faulthandler's report, written at the same moment
        # from its own thread, comes before or after this one, never inside it.
        report = f"{head}; threads: {states}\nits threads' native frames:\n{native_stacks(pid)}"
        print(report, file=sys.stderr, flush=True)


def split_threads(report: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """A report's (py-spy's or faulthandler's) lines before its first thread, and each
    thread's header and frames."""
    head: list[str] = []
    threads: list[tuple[str, list[str]]] = []
    for line in report:
        if _THREAD.match(line):
            threads.append((line, []))
        elif line.strip():
            (threads[-1][1] if threads else head).append(line)
    return head, threads


def is_thread_header(line: str) -> bool:
    return _THREAD.match(line) is not None


def _frame(line: str) -> str:
    line = _PATH.sub(r'File "\g<tail>', line)
    return line if len(line) <= 160 else line[:157] + "..."  # C++ template names


def compact(report: list[str], *, main_frames: int = 30, other_frames: int = 4) -> list[str]:
    """A report cut to what a log's tail holds: its first line, the main thread's innermost
    `main_frames` frames up to an actor's `call_within` (py-spy names the main thread; in
    faulthandler's report, it is the thread in that call), the innermost `other_frames` of
    each thread py-spy saw active (more of one holding the interpreter lock, which every
    other thread waits for), and how many threads were left out."""
    head, threads = split_threads(report)
    # the first line whole (a hang report's names the threads), the command line cut
    out = head[:1] + [_frame(h) for h in head if h.startswith("Process ")]
    named = any('"MainThread"' in header for header, _ in threads)
    left = 0
    for header, frames in threads:
        if '"MainThread"' in header or (
            not named and any("call_within" in f or "in call\n" in f + "\n" for f in frames)
        ):
            ours = _host_frame(frames)
            out += [header] + [_frame(f) for f in frames[: min(ours or main_frames, main_frames)]]
        elif "gil)" in header:  # holds the interpreter lock: what every other thread waits for
            out += [header] + [_frame(f) for f in frames[: max(other_frames, 12)]]
        elif "(active)" in header:
            out += [header] + [_frame(f) for f in frames[:other_frames]]
        else:
            left += 1
    if left:
        out.append(f"({left} other threads, idle or unnamed, left out)")
    return out


def _host_frame(frames: list[str]) -> int | None:
    """How many of a thread's frames (innermost first) run up to its actor's `call_within`,
    else up to its `ActorHost.call` (a call made past `call_within`): Ray's frames below are
    the same in every report."""
    within = [i for i, f in enumerate(frames) if "call_within" in f]
    if within:
        return within[0] + 1
    # py-spy's "ActorHost.call (launcher.py:113)", faulthandler's 'File "...", line 113 in call'
    call = [
        i
        for i, f in enumerate(frames)
        if "ActorHost.call " in f or (f.rstrip().endswith(" in call") and "launcher.py" in f)
    ]
    return call[0] + 1 if call else None


def where_is(pid: int, *, timeout_s: float = 20.0, main_frames: int = 25) -> str:
    """Another process's threads as this one finds them from outside (py-spy needs no
    interpreter lock of the process it reads, so a process whose lock is held, or whose main
    thread never returned to take a call, is read all the same): the count of its threads by
    name and state, then its main thread's native and Python frames, compacted."""
    dump = native_stacks(pid, timeout_s=timeout_s).splitlines()
    lines = compact(dump, main_frames=main_frames, other_frames=4)
    lines = [ln for ln in lines if not ln.startswith("Process ")]
    return f"threads: {thread_states(pid)}\n" + "\n".join(lines)
