"""Open file descriptors and resident memory of a process and its descendants (Linux /proc),
for leak checks over long runs."""

from __future__ import annotations

import os


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def process_tree_stats(pid: int | None = None) -> dict[str, int]:
    """{"processes", "fds", "rss_bytes"} summed over `pid` (default: this one) and descendants."""
    todo, seen = [pid or os.getpid()], set()
    fds = rss = 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        todo += _children(p)
    return {"processes": len(seen), "fds": fds, "rss_bytes": rss}
