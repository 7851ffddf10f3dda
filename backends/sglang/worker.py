"""SglDTensorV2WeightSyncWorker: the trainer-side Ray actor for SGLang engines (env "sglang").

It runs in the sglang env so that it can use what only that env has (SGLang's own process-group
helpers for the non-colocated path); the colocated path is the core's: buckets through shared
memory on CPU, each bucket announced to the engine actor as plain data.
"""

from __future__ import annotations

from weightsync.apps.worker import DTensorV2WeightSyncWorker


class SglDTensorV2WeightSyncWorker(DTensorV2WeightSyncWorker):
    engine_env = "sglang"
