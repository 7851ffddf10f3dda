"""The trainer ranks' side channel (weightsync/trainer/sync_group.py): plain data as JSON over gloo,
never pickle, between two spawned ranks; a trainer of one rank sends nothing."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.conftest import free_port


def _rank(rank: int, world_size: int, port: int, results) -> None:
    import pickle

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group
    from weightsync.trainer.sync_group import SyncGroup

    def refuse(*args, **kwargs):
        raise AssertionError("the sync group unpickled something from a peer")

    # Whatever a peer sends, nothing here may unpickle it.
    c10d._tensor_to_object = refuse
    pickle.loads = refuse
    pickle.Unpickler = refuse
    init_trainer_group(
        rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    group = SyncGroup(timeout_s=60)
    if world_size == 1:  # one rank sends nothing
        for name in ("broadcast", "all_gather", "gather"):
            setattr(dist, name, refuse)
    out: dict = {}
    plan = {"one_copy": ["a"], "new": {"a": {"segment": "x", "offsets": {"t": 64}}}, "n": None}
    out["broadcast"] = group.broadcast(plan if rank == 0 else None)
    out["gathered"] = group.gather((rank, [f"bad-{rank}"], 0.5 * rank, 10**12))
    try:
        group.broadcast(object() if rank == 0 else None)
    except Exception as exc:  # noqa: BLE001 - which class, on which rank, is the result
        out["unencodable"] = f"{type(exc).__name__}: {exc}"
    out["after"] = group.broadcast("still in step" if rank == 0 else None)
    group.close()
    close_trainer_group()
    results.put((rank, out))


@pytest.mark.parametrize("world_size", [2, 1])
def test_plain_data_crosses_as_json_and_an_unencodable_value_fails_every_rank(world_size):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, port, results)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = {"one_copy": ["a"], "new": {"a": {"segment": "x", "offsets": {"t": 64}}}, "n": None}
    assert outs[0]["broadcast"] == want
    assert outs[0]["unencodable"].startswith("TypeError: sync group: Object of type object")
    assert outs[0]["after"] == "still in step"
    if world_size == 1:
        assert outs[0]["gathered"] == [[0, ["bad-0"], 0.0, 10**12]]
        return
    assert outs[1]["broadcast"] == want
    assert outs[0]["gathered"] == [[0, ["bad-0"], 0.0, 10**12], [1, ["bad-1"], 0.5, 10**12]]
    assert outs[1]["gathered"] is None
    assert outs[1]["unencodable"].startswith("RuntimeError: sync group: rank 0 could not")
    assert outs[1]["after"] == "still in step"


def _late_rank(rank: int, port: int, results) -> None:
    import os
    import time

    from weightsync.trainer.process_group import init_trainer_group
    from weightsync.trainer.sync_group import SyncGroup

    init_trainer_group(
        rank=rank,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=port,
        device="cpu",
        timeout_s=2,
    )
    group = SyncGroup(timeout_s=60)
    if rank == 1:
        time.sleep(5)  # still in its previous call when rank 0 begins the sync
    try:
        group.recover()
        results.put((rank, "recovered"))
    except RuntimeError as exc:
        results.put((rank, str(exc)))
    results.close()
    results.join_thread()  # the answer is sent before the process leaves
    os._exit(0)  # the group is out of step: no clean exit through it


def test_a_rank_that_does_not_begin_the_sync_in_time_is_named_as_the_cause():
    """A sync's first collective (whether the last one failed anywhere) waits the training
    group's timeout for every rank; a rank still busy elsewhere fails it with a message that
    says so, not gloo's bare receive timeout."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_late_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):  # the rank that came late finds the other gone
        assert outs[rank].startswith(f"trainer rank {rank}: the ranks did not all begin"), outs
        assert "every rank must call sync() together" in outs[rank]
