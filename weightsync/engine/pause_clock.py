"""The clock of a staged update's switch: its one pause, timed in parts (`EndReport.pause_s`,
`EndReport.pause_parts`), inside whichever process runs the switch (an engine actor, or the
middleware of an engine's server)."""

from __future__ import annotations

import time
from typing import Any


class PauseClock:
    """Started when the pause starts; `mark(part)` as each part ends; `report()`."""

    def __init__(self) -> None:
        self._marks = [("start", time.perf_counter())]

    def mark(self, part: str) -> None:
        self._marks.append((part, time.perf_counter()))

    def report(self) -> dict[str, Any]:
        """{"pause_s": seconds from start to the last mark, "pause_parts": {part: seconds}}."""
        marks = self._marks
        parts = {name: t - prev for (_, prev), (name, t) in zip(marks, marks[1:])}
        return {"pause_s": marks[-1][1] - marks[0][1], "pause_parts": parts}
