"""The trainer rank of `weightsync bench`: the DTensorV2 worker plus the measurements that need
the trainer's own process (memcpy, gather, transport alone, gather + save). Apart from bench.py
so that the CLI imports without torch."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from weightsync.apps.worker import DTensorV2WeightSyncWorker


class BenchWorker(DTensorV2WeightSyncWorker):
    """The trainer worker plus the measurements that need the trainer's process."""

    def bench_memcpy(self, nbytes: int, repeats: int = 3) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))

    def bench_gather(self) -> float:
        start = time.perf_counter()
        for _ in self.weights.source.tensors():
            pass
        return time.perf_counter() - start

    def bench_gather_save(self, out_dir: str) -> float:
        """Gather every tensor and write one safetensors file (rank 0); seconds for both."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        state = dict(self.weights.source.tensors())
        if self.rank == 0:
            save_file(state, os.path.join(out_dir, "model.safetensors"))
        seconds = time.perf_counter() - start
        if self.rank == 0:
            for name in os.listdir(self.model_path):
                if name.endswith((".json", ".txt")) and "index" not in name:
                    shutil.copy(os.path.join(self.model_path, name), out_dir)
        return seconds

    def bench_transport(self) -> float:
        """Pack already-gathered tensors into shared-memory buckets and copy them out into
        preallocated tensors through a receiver mapping: the transport alone, no gather, no
        engine. Rank 0 measures; the other ranks only take part in the gather beforehand."""
        from weightsync.transports.shm import ShmReceiver, ShmSender
        from weightsync.wire.bucket import fill_buckets, plan_buckets, unpack

        tensors = list(self.weights.source.tensors())
        if self.rank != 0:
            return 0.0
        specs = self.weights.source.specs()
        plans = plan_buckets(specs, capacity_bytes=self.weights.options.bucket_bytes)
        dst = {name: torch.empty_like(t) for name, t in tensors}
        sender, receiver = ShmSender(num_slots=2), ShmReceiver()

        def one_pass() -> float:
            start = time.perf_counter()
            for plan in fill_buckets(
                plans, iter(tensors), lambda p: sender.buffer(p.index % 2, p.nbytes)
            ):
                desc = plan.descriptor(sender.handle(plan.index % 2))
                for name, view in unpack(receiver.receive(desc.handle, desc.nbytes), desc):
                    dst[name].copy_(view)
            return time.perf_counter() - start

        one_pass()  # first touch of the segments' pages
        seconds = one_pass()
        receiver.close()
        sender.close()
        return seconds


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
