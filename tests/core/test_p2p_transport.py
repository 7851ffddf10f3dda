"""The point-to-point transport (weightsync/transports/p2p.py) run by real processes: three FSDP2
trainer ranks over gloo (a tiny Qwen2, shards of uneven rows) send straight to four engine
workers (two replicas of two tensor-parallel workers, each holding rows, columns or the whole
of each tensor, its placements learned by the project's learner from its slicing loader; and a
fifth worker that keeps nothing, which takes part all the same). Each
worker ends with exactly its slice of the trainer's weights, twice (the second sync after a
change), and each rank sends only the pieces of its own shards: what the senders report is the
plan's links, and rank 0's share of them is recounted element by element from the holdings and
placements, independently of the planner."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from weightsync.wire.placement import learn_placement
from weightsync.wire.transfer_plan import TransferPlan, plan_transfers

NUM_RANKS, TP, REPLICAS = 3, 2, 2
SEED = 5
_ROWS = re.compile(r"(embed_tokens|lm_head|[qkv]_proj|gate_proj|up_proj)\.")
_COLUMNS = re.compile(r"(o_proj|down_proj)\.weight")


def _step(tensor: torch.Tensor, sync: int) -> None:
    """A training step's worth of change, the same on a shard as on the whole tensor."""
    tensor.mul_(1.5 + sync).add_(0.25)


def _slice(name: str, tensor: torch.Tensor, worker: int) -> torch.Tensor:
    """What a tensor-parallel worker's loader keeps of a tensor."""
    if _ROWS.search(name):
        return tensor.chunk(TP, dim=0)[worker]
    if _COLUMNS.search(name):
        return tensor.chunk(TP, dim=1)[worker]
    return tensor


def _trainer(rank: int, port: int, inbox: Any, outbox: Any) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from weightsync.apps.models import build_model
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )
    from weightsync.transports.p2p import PointToPointSender

    init_trainer_group(
        rank=rank, world_size=NUM_RANKS, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    model = shard_model(build_model("qwen2", "tiny", seed=SEED), device="cpu")
    shards: dict[str, tuple[int, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        local = param.to_local().detach()  # type: ignore[operator]
        _, offset = compute_local_shape_and_global_offset(
            param.shape,
            param.device_mesh,  # type: ignore[attr-defined]
            param.placements,  # type: ignore[attr-defined]
        )
        if local.numel():
            shards[name] = (offset[0] * math.prod(param.shape[1:]), local)
    outbox.put(("holdings", rank, {n: (s, s + t.numel()) for n, (s, t) in shards.items()}))
    plan_dict, store_port = inbox.get(timeout=120)
    sender = PointToPointSender(TransferPlan.from_dict(plan_dict), rank, port=store_port)
    if rank == 0:
        outbox.put(("port", sender.port))
    sent = []
    for sync in range(2):
        with torch.no_grad():
            for _, local in shards.values():
                _step(local, sync)
        sent.append(sender.send({n: (s, t.reshape(-1)) for n, (s, t) in shards.items()}))
    outbox.put(("sent", rank, sent))
    sender.close()
    close_trainer_group()


def _worker(worker: int, shapes: dict, inbox: Any, outbox: Any) -> None:
    from weightsync.transports.p2p import PointToPointReceiver

    local = worker % TP  # its place in its replica
    params, placements = {}, {}
    for name, shape in shapes.items() if worker < TP * REPLICAS else ():  # the last keeps none
        param = torch.zeros(_slice(name, torch.empty(shape), local).shape)
        pats = learn_placement(
            param,
            torch.float32,
            tuple(shape),
            lambda t, param=param, name=name: param.copy_(_slice(name, t, local)),
        )
        assert pats is not None, name
        params[name], placements[name] = param, [name, pats]
    outbox.put(("placements", worker, placements))
    plan_dict, store_port = inbox.get(timeout=120)
    receiver = PointToPointReceiver(TransferPlan.from_dict(plan_dict), worker, port=store_port)
    for sync in range(2):
        got = receiver.receive(params)
        # As bytes: a tensor through a torch queue is a file descriptor, gone when this exits.
        raw = {n: (p.numpy().tobytes(), list(p.shape)) for n, p in params.items()}
        outbox.put(("received", worker, sync, got, raw))
    receiver.close()


def test_each_rank_sends_its_own_pieces_straight_to_the_workers_that_keep_them():
    from weightsync.apps.models import build_model

    full = {
        n: p.detach().clone() for n, p in build_model("qwen2", "tiny", seed=SEED).named_parameters()
    }
    shapes = {n: list(t.shape) for n, t in full.items()}
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    num_workers = TP * REPLICAS + 1  # and a worker the plan gives nothing: it still takes part
    inboxes = [ctx.Queue() for _ in range(NUM_RANKS + num_workers)]
    port = free_port()
    procs = [
        ctx.Process(target=_trainer, args=(r, port, inboxes[r], outbox)) for r in range(NUM_RANKS)
    ] + [
        ctx.Process(target=_worker, args=(w, shapes, inboxes[NUM_RANKS + w], outbox))
        for w in range(num_workers)
    ]
    for p in procs:
        p.start()
    try:
        holdings: dict[str, list] = {}
        workers: list[dict] = [{} for _ in range(num_workers)]
        for _ in range(NUM_RANKS + num_workers):
            kind, who, what = outbox.get(timeout=240)
            if kind == "holdings":
                for name, (start, stop) in what.items():
                    holdings.setdefault(name, []).append((who, start, stop))
            else:
                workers[who] = what
        plan = plan_transfers({n: 4 for n in full}, holdings, workers, num_ranks=NUM_RANKS)
        inboxes[0].put((plan.to_dict(), None))  # rank 0 hosts the group's store
        kind, store_port = outbox.get(timeout=120)
        assert kind == "port"
        for inbox in inboxes[1:]:
            inbox.put((plan.to_dict(), store_port))
        received: dict[tuple[int, int], dict] = {}
        sent: dict[int, list] = {}
        for _ in range(num_workers * 2 + NUM_RANKS):
            message = outbox.get(timeout=240)
            if message[0] == "sent":
                sent[message[1]] = message[2]
            else:
                _, worker, sync, got, params = message
                received[(worker, sync)] = (got, params)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)

    for sync in range(2):
        for tensor in full.values():
            _step(tensor, sync)
        assert received[(num_workers - 1, sync)] == ({}, {})
        for w in range(num_workers - 1):
            got, params = received[(w, sync)]
            for name, tensor in full.items():
                raw, shape = params[name]
                held = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(shape)
                assert torch.equal(held, _slice(name, tensor, w % TP)), (sync, w, name)
    # Bytes: what each rank sent each worker is what the plan gives that link, and rank 0 sent
    # exactly the kept elements of its own shards, a fraction of the whole.
    link_bytes = plan.link_bytes()
    for r, per_sync in sent.items():
        for sync_sent in per_sync:
            assert sync_sent == {w: link_bytes[(r, w)] for w in plan.sends(r)}
    rank0 = 0
    for name, held in holdings.items():
        start, stop = next((a, b) for r, a, b in held if r == 0)
        for placed in workers:
            for p in placed[name][1] if name in placed else ():
                rank0 += 4 * sum(
                    max(0, min(stop, s + p[2]) - max(start, s))
                    for s in range(p[1], p[1] + p[3] * max(p[5], 1), max(p[5], 1))
                )
    total = sum(link_bytes.values())
    assert sum(sent[0][0].values()) == rank0 < total / 2
    assert total == sum(
        4 * sum(p[2] * p[3] for _, pats in w.values() for p in pats) for w in workers
    )


def test_a_shard_the_views_cannot_be_made_over_is_refused_naming_it():
    from weightsync.transports.p2p import PointToPointSender

    plan = plan_transfers(
        {"w": 4}, {"w": [(0, 0, 12)]}, [{"w": ["w", [[0, 0, 12, 1, 0, 0]]]}], num_ranks=1
    )
    sender = PointToPointSender(plan, 0)
    try:
        transposed = torch.zeros(4, 3).t()
        with pytest.raises(ValueError, match="tensor 'w': the shard is not contiguous"):
            sender._views({"w": (0, transposed)})
        with pytest.raises(ValueError, match="tensor 'w': the shard has 2-byte elements"):
            sender._views({"w": (0, torch.zeros(12, dtype=torch.bfloat16))})
    finally:
        sender.close()
