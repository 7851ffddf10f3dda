"""Open file descriptors and resident memory of a process and its descendants, for leak checks
over long runs."""

from __future__ import annotations

import psutil


def process_tree_stats(pid: int | None = None) -> dict[str, int]:
    """{"processes", "fds", "rss_bytes"} summed over `pid` (default: this one) and descendants."""
    root = psutil.Process(pid)
    fds = rss = processes = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                fds += proc.num_fds()
                rss += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        processes += 1
    return {"processes": processes, "fds": fds, "rss_bytes": rss}
