"""weightsync's vLLM worker extension with a switch fault a test plants over HTTP.

A server started with `--worker-extension-cls tests.vllm.planted_extension.PlantedExtension`
(instead of weightsync's `WeightsyncWorkerExtension`, whose behaviour it keeps) takes two more
methods through its `/collective_rpc` route, by name with JSON arguments: `planted_switch(rank)`
makes tensor-parallel worker `rank`'s staged switch fail before writing anything while the other
workers switch (tests/vllm/planted.py `plant_switch`), `planted_partial_switch(rank)` after
writing some of its parameters (`plant_partial_switch`), `planted_slow_switch(seconds, marker)`
makes every worker's switch wait first (`plant_slow_switch`), `planted_unswitch()` puts either
back.
"""

from __future__ import annotations

from tests.vllm.planted import (
    plant_partial_switch,
    plant_slow_switch,
    plant_switch,
    unplant_switch,
)
from weightsync.backends.vllm.extension import WeightsyncWorkerExtension


class PlantedExtension(WeightsyncWorkerExtension):
    """Answers are JSON objects (the server's route turns other values into strings)."""

    def planted_switch(self, rank: int) -> dict[str, bool]:
        return {"planted": plant_switch(self, rank)}

    def planted_partial_switch(self, rank: int) -> dict[str, bool]:
        return {"planted": plant_partial_switch(self, rank)}

    def planted_slow_switch(self, seconds: float, marker: str) -> dict[str, bool]:
        return {"planted": plant_slow_switch(self, seconds, marker)}

    def planted_unswitch(self) -> dict[str, bool]:
        return {"planted": unplant_switch(self)}
