"""SglDTensorV2WeightSyncWorker: the trainer-side Ray actor for SGLang engines (env "sglang").

It runs in the sglang env (the launcher's `ACTORS`) so that a trainer rank can use what only
that env has (SGLang's own process-group helpers for the non-colocated path); the colocated path
is the core's: buckets through shared memory on CPU, each bucket announced to the engine actor
as plain data. At construction it checks, in its own process, that it does run there (sglang
installed beside the torch the process runs), and refuses otherwise before it builds anything.
"""

from __future__ import annotations

from typing import Any

from weightsync.apps.worker import DTensorV2WeightSyncWorker, check_engine_env


class SglDTensorV2WeightSyncWorker(DTensorV2WeightSyncWorker):
    """`DTensorV2WeightSyncWorker` in the sglang env; raises RuntimeError naming the env and
    the fix when started anywhere else. `kwargs`: `DTensorV2WeightSyncWorker`'s."""

    def __init__(self, **kwargs: Any) -> None:
        self._engine_versions = check_engine_env(type(self).__name__, "sglang")
        super().__init__(**kwargs)

    def engine_versions(self) -> dict[str, str]:
        """{"env", "sglang", "torch"}: the env this rank runs in and its versions (any rank)."""
        return dict(self._engine_versions)
