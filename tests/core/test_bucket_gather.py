"""The bucket gather (`BucketGatherWriter`): with a transport whose bucket only rank 0 writes
(here gloo), the ranks' shards reach rank 0 in one gather per bucket, not one all-gather per
tensor. Real gloo FSDP2 ranks on CPU, syncing into an in-process reference receiver on rank 0
over the gloo broadcast transport."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import free_port
from weightsync.trainer.endpoint import Endpoint

NUM_BLOCKS = 12
BUCKET_BYTES = 1024
# Every collective a trainer rank may issue through torch.distributed.
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "recv",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


class _Block(nn.Module):
    """Dim-0 shards of every kind: rows that divide among the ranks, rows that do not, and a
    tensor with fewer rows than ranks."""

    def __init__(self, index: int, generator: torch.Generator) -> None:
        super().__init__()
        self.even = nn.Parameter(torch.randn(6, 5, generator=generator))
        self.odd = nn.Parameter(torch.randn(2 * index + 3, 3, generator=generator))
        self.one_row = nn.Parameter(torch.randn(1, 7, generator=generator))
        self.bias = nn.Parameter(torch.randn(5 + index % 3, generator=generator))


class _ManyTensors(nn.Module):
    """4 * NUM_BLOCKS dim-0 sharded tensors, one replicated DTensor, one tensor-parallel
    (sharded on dim 1) DTensor and one plain tensor (the last three set by `_shard`)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(_Block(i, generator) for i in range(NUM_BLOCKS))
        self.replicated = nn.Parameter(torch.randn(9, 4, generator=generator))
        self.tensor_parallel = nn.Parameter(torch.randn(3, 8, generator=generator))
        self.plain = nn.Parameter(torch.randn(5, generator=generator))


def _shard(model: _ManyTensors, world_size: int) -> _ManyTensors:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    with torch.no_grad():
        model.replicated = nn.Parameter(distribute_tensor(model.replicated, mesh, [Replicate()]))
        model.tensor_parallel = nn.Parameter(
            distribute_tensor(model.tensor_parallel, mesh, [Shard(1)])
        )
    return model


class _ThreadEndpoint(Endpoint):
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


def _count_collectives(counts: Counter) -> None:
    """Count every torch.distributed collective, and every DTensor `full_tensor()` (an
    all-gather through functional collectives), into `counts`."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def counting(name: str, call: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return call(*args, **kwargs)

        return counted

    for name in COLLECTIVES:
        setattr(dist, name, counting(name, getattr(dist, name)))
    DTensor.full_tensor = counting("full_tensor", DTensor.full_tensor)  # type: ignore[method-assign]


def _module_of(specs: list[dict]) -> nn.Module:
    """A plain module whose parameters carry the names and shapes of `specs` (zeros)."""
    root = nn.Module()
    for spec in specs:
        *path, leaf = spec["name"].split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(spec["shape"])))
    return root


def _rank_main(
    rank: int, world_size: int, port: int, results, options: dict, model_kind: str
) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(
        rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    counts: Counter = Counter()
    _count_collectives(counts)
    if model_kind == "moe":  # grouped experts, sent per expert under checkpoint names
        from weightsync.apps.models import build_model

        model = shard_model(build_model("qwen3_moe", "tiny", seed=3), device="cpu")
    else:
        model = _shard(_ManyTensors(seed=3), world_size)
    sync = TrainerSync(
        model,
        options=SyncOptions(transport="gloo", bucket_bytes=BUCKET_BYTES, timeout_s=60, **options),
    )
    engine = None
    if rank == 0:
        engine = _ManyTensors(seed=99) if model_kind == "many" else _module_of(sync.refit_info())
    endpoint = _ThreadEndpoint(ModuleWeightReceiver(engine), name="ref") if rank == 0 else None
    sync.connect({"ref": endpoint} if rank == 0 else {})
    out: dict = {"rank": rank, "counts": [], "reports": [], "equal": []}
    for version in ("v1", "v2"):
        with torch.no_grad():  # a training step's worth of change on every rank's part
            for param in model.parameters():
                getattr(param, "to_local", lambda p=param: p)().mul_(1.5).add_(0.25)
        counts.clear()
        report = sync.sync(version, verify=True)
        out["counts"].append(dict(counts))
        full = dict(sync.source.tensors())  # every rank takes part in each gather
        if rank == 0:
            params = dict(engine.named_parameters())
            out["reports"].append(report)
            out["equal"].append(
                {name: torch.equal(params[name].detach(), t) for name, t in full.items()}
            )
    out["num_tensors"] = len(sync.refit_info())
    out["num_dtensors"] = sum(hasattr(p, "placements") for p in model.parameters())
    results.put(out)
    sync.close()
    close_trainer_group()


def _run(world_size: int = 2, model_kind: str = "many", **options) -> dict[int, dict]:
    """Every rank's record of two verified syncs of a `_ManyTensors` ("many") or a tiny
    Qwen3-MoE ("moe") model."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, results, options, model_kind))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs = {}
    for _ in procs:
        out = results.get(timeout=240)
        outs[out["rank"]] = out
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * world_size
    return outs


def _num_collectives(counts: dict) -> int:
    return sum(counts.values())


def test_a_bucket_sync_issues_collectives_per_bucket_not_per_tensor():
    new = _run()
    old = _run(shard_writes=False)
    num_tensors = new[0]["num_tensors"]
    num_buckets = new[0]["reports"][0].num_buckets
    assert num_tensors == 4 * NUM_BLOCKS + 3 and num_tensors >= 4 * num_buckets > 4
    print(
        f"{num_tensors} tensors, {num_buckets} buckets; collectives per sync: "
        f"bucket gather {[c for c in new[0]['counts']]}, per tensor {[c for c in old[0]['counts']]}"
    )
    for rank in (0, 1):
        first, steady = new[rank]["counts"]
        for counts in (first, steady):
            # One gather per bucket; the tensor-parallel tensor alone is gathered on its own.
            assert counts.get("gather", 0) <= num_buckets + 1
            assert counts.get("full_tensor", 0) == 1
        # The rest: the sync's own handful (recover, plan, verification, and rank 0's word that
        # the sync goes on after each bucket still loading and after the stage: a broadcast of
        # two collectives each), the same every sync; the first sync also learns which rank
        # sends which bytes (a gather and a broadcast).
        assert _num_collectives(steady) <= num_buckets + 14
        assert _num_collectives(first) <= _num_collectives(steady) + 4
        # Today's path without shard writes: an all-gather per sharded tensor.
        for counts in old[rank]["counts"]:
            assert counts.get("full_tensor", 0) == new[rank]["num_dtensors"] > 4 * NUM_BLOCKS
            assert _num_collectives(counts) >= num_tensors - 2
        assert _num_collectives(steady) * 3 < _num_collectives(old[rank]["counts"][1])


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_bucket_gather_delivers_every_tensor_bit_exact_and_verified(world_size):
    outs = _run(world_size)
    for report, equal in zip(outs[0]["reports"], outs[0]["equal"]):
        assert report.path == "buckets" and report.verify["ref"].verified
        assert not report.verify["ref"].mismatched
        assert len(equal) == outs[0]["num_tensors"]
        assert [name for name, same in equal.items() if not same] == []


def test_grouped_experts_reach_rank_0_in_the_bucket_gather_without_a_gather_per_tensor():
    outs = _run(model_kind="moe")
    for report, equal in zip(outs[0]["reports"], outs[0]["equal"]):
        assert report.verify["ref"].verified and all(equal.values())
        assert any(".experts.0.gate_proj." in name for name in equal)
    for out in outs.values():
        for counts in out["counts"]:
            assert counts.get("full_tensor", 0) == 0
            assert counts.get("gather", 0) <= outs[0]["reports"][0].num_buckets + 1
