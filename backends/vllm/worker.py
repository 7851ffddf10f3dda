"""VllmDTensorV2WeightSyncWorker: the trainer-side Ray actor for vLLM engines (env "vllm" on
GPU machines, "vllm-cpu" elsewhere); the colocated path is the core's shared-memory buckets. At
construction it checks, in its own process, that it runs in one of those envs (vLLM installed
beside the torch the process runs), and refuses otherwise before it builds anything.
"""

from __future__ import annotations

from typing import Any

from weightsync.apps.worker import DTensorV2WeightSyncWorker, check_engine_env


class VllmDTensorV2WeightSyncWorker(DTensorV2WeightSyncWorker):
    """`DTensorV2WeightSyncWorker` in a vLLM env; raises RuntimeError naming the envs and the
    fix when started anywhere else. `kwargs`: `DTensorV2WeightSyncWorker`'s."""

    def __init__(self, **kwargs: Any) -> None:
        self._engine_versions = check_engine_env(type(self).__name__, "vllm")
        super().__init__(**kwargs)

    def engine_versions(self) -> dict[str, str]:
        """{"env", "vllm", "torch"}: the env this rank runs in and its versions (any rank)."""
        return dict(self._engine_versions)
