"""What a failed test leaves for the end of a CI log: its one-line reason and the hang reports
(weightsync/driver/hang_report.py) its actors wrote, compacted. scripts/test.sh names the file
(`WEIGHTSYNC_FAILURE_LOG`) and prints it after the suites, where a log's tail is read."""

from __future__ import annotations

import os
import re

import psutil

from weightsync.driver.hang_report import MARK, compact, is_thread_header, native_stacks

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix on an actor's output line in the driver: "(ActorHost pid=123) " or with ", ip=".
_PREFIX = re.compile(r"^\((?P<who>[^()]*pid=(?P<pid>\d+)[^()]*)\) ?")


def _by_pid(captured: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in captured.splitlines():
        line = _ANSI.sub("", raw)
        found = _PREFIX.match(line)
        if found:
            out.setdefault(found["pid"], []).append(line[found.end() :])
    return out


def _reports(lines: list[str]) -> tuple[list[str], list[str]]:
    """The last native (py-spy) report and the last Python-frames (faulthandler) report among
    one actor's lines."""
    native: list[str] = []
    python: list[str] = []
    current: list[str] | None = None
    for line in lines:
        if line.startswith(MARK):
            native = current = [line]
        elif line.startswith("Timeout ("):
            python = current = [line]
        elif current is not None:
            threads_begun = any(is_thread_header(seen) for seen in current)
            if threads_begun and line.strip() and not line.startswith((" ", "\t")):
                if not is_thread_header(line):
                    current = None  # the report ended: the actor's other output follows
                    continue
            current.append(line)
    return native, python


def hang_reports(captured: str, *, limit: int = 5000) -> str:
    """The hang reports in a test's captured output, one actor after another, compacted to at
    most `limit` characters: each actor's native report where it wrote one (its frames name
    Python and native functions), else its Python one."""
    parts = []
    for pid, lines in _by_pid(captured).items():
        native, python = _reports(lines)
        chosen = native if len(native) > 1 else python
        if chosen:
            parts.append(f"-- pid {pid}\n" + "\n".join(compact(chosen)))
    text = "\n".join(parts)
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut)"


# Processes whose stacks a failed engine test reports: engine actors, engines' own processes.
_ENGINE_PROCESSES = ("ray::ActorHost", "VLLM::", "vllm.entrypoints", "sglang")


def process_stacks(*, limit: int = 3500, budget_s: float = 40.0) -> str:
    """The native stacks (py-spy) of the engine actors and engine processes alive now, each
    compacted (main thread and active threads), at most `limit` characters in all."""
    import time

    deadline = time.monotonic() + budget_s
    parts = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] == os.getpid() or not any(m in command for m in _ENGINE_PROCESSES):
            continue
        left = deadline - time.monotonic()
        if left < 5:
            parts.append("(time for stacks ran out)")
            break
        dump = native_stacks(proc.info["pid"], timeout_s=min(20.0, left)).splitlines()
        short = compact(dump, main_frames=10, other_frames=3)
        short = [ln for ln in short if not ln.startswith("Process ")]  # the line above says
        parts.append(f"-- pid {proc.info['pid']} {command[:100]}\n" + "\n".join(short))
    text = "\n".join(parts)
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut)"
