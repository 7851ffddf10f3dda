"""CPU bucket syncs of many small tensors: one gather per bucket against one all-gather per tensor.

  python scripts/bucket_gather_bench.py --tensors 2000 --repeats 3

The trainer is `TrainerSync` on 2 FSDP2 ranks (gloo, float32, one thread each), over a model of
`--tensors` tensors of `--rows` x `--cols` (odd rows: uneven shards), in blocks of 40 that
are each an FSDP2 unit. Transport `gloo`: rank 0 broadcasts each bucket to a
`ModuleWeightReceiver` in a thread of rank 0's process. Each path gets a fresh trainer sync
and receiver:
- gather: `SyncOptions(shard_writes=True)`, the ranks' shards of a bucket reach rank 0 in one
  gather (`BucketGatherWriter`);
- per_tensor: `SyncOptions(shard_writes=False)`, rank 0 sends full tensors, each gathered on its
  own (`full_tensor()`).
Measured: rank 0's wall time of `TrainerSync.sync()` (the receiver's loads included), best of
`--repeats` after one warm-up sync, the ranks lined up by a barrier before each; tensors/s; and
whether a verified sync after the timed ones passed. Prints one JSON line per path.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from weightsync.trainer.endpoint import Endpoint

BLOCK_TENSORS = 40


class ThreadEndpoint(Endpoint):
    """A receiver in this process whose calls run in order on a thread of their own: a gloo
    receiver waits in its broadcast while the sender sends."""

    def __init__(self, receiver: Any, *, name: str) -> None:
        self.receiver = receiver
        self.name = name
        self.pool = ThreadPoolExecutor(1)

    def submit(self, method: str, *args: Any) -> Any:
        return self.pool.submit(getattr(self.receiver, method), *args)

    def wait(self, ticket: Any, *, timeout_s: float) -> Any:
        return ticket.result(timeout=timeout_s)


def _model(num_tensors: int, rows: int, cols: int, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Module()
    model.blocks = nn.ModuleList()
    for start in range(0, num_tensors, BLOCK_TENSORS):
        block = nn.Module()
        for i in range(min(BLOCK_TENSORS, num_tensors - start)):
            block.register_parameter(
                f"w{i}", nn.Parameter(torch.randn(rows, cols, generator=generator))
            )
        model.blocks.append(block)
    return model


def _rank_main(rank: int, port: int, args: argparse.Namespace, path: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import SyncOptions, TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    torch.set_num_threads(1)
    init_trainer_group(
        rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    model = _model(args.tensors, args.rows, args.cols, seed=3)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    options = SyncOptions(
        transport="gloo",
        bucket_bytes=args.bucket_mb << 20,
        shard_writes=path == "gather",
        timeout_s=300,
        verify=False,  # the timed syncs; the last one verified on its own
    )
    sync = TrainerSync(model, options=options)
    endpoint = None
    if rank == 0:
        engine = _model(args.tensors, args.rows, args.cols, seed=99)
        endpoint = ThreadEndpoint(ModuleWeightReceiver(engine), name="ref")
    sync.connect({"ref": endpoint} if rank == 0 else {})
    sync.sync("warm-up")
    best = float("inf")
    num_buckets = 0
    for i in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        report = sync.sync(f"v{i}")
        best = min(best, time.perf_counter() - start)
        if report is not None:
            num_buckets = report.num_buckets
    report = sync.sync("verified", verify=True)
    if rank == 0:
        nbytes = sum(s["nbytes"] for s in sync.refit_info())
        results.put(
            {
                "path": path,
                "tensors": args.tensors,
                "buckets": num_buckets,
                "mb": round(nbytes / 2**20, 2),
                "sync_s": round(best, 4),
                "tensors_per_s": round(args.tensors / best),
                "verified": bool(report.verify["ref"].verified),
            }
        )
    sync.close()
    close_trainer_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=33)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default="gather,per_tensor")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for path in args.paths.split(","):
        results = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, port, args, path, results)) for r in range(2)
        ]
        for p in procs:
            p.start()
        print(json.dumps(results.get(timeout=1200)), flush=True)
        for p in procs:
            p.join(timeout=120)


if __name__ == "__main__":
    main()
