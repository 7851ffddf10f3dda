"""A tensor-parallel engine's first verified sync is checked before the engine commits it.

Its workers hold slices of each tensor, placed as their own loaders place them; those
placements are learned while the first sync loads, so the expected fingerprints of each worker
can only be computed once the engine staged the update: the trainer's ranks read the tensors
again then, and a worker whose bytes differ fails the sync before `end`, like every later sync.
Real 2-process gloo FSDP2 trainer; two sliced reference receivers stand for two TP workers.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from tests.conftest import free_port
from tests.core.test_placement import sliced_model


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(4):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(8, 6)))
    return model


def _rank(rank: int, port: int, results, options: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import SyncOptions, TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    class Garbled(ModuleWeightReceiver):
        """A worker whose bytes of `w2` differ from what was sent once loaded (as a bad
        transfer would leave them), while `garbled` is set."""

        garbled = True

        def _engine_stage(self):
            if self.garbled:
                with torch.no_grad():
                    self.receiver.model.w2.add_(1.0)
            return super()._engine_stage()

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    full = _model()
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sync = TrainerSync(model, options=SyncOptions(verify=True, timeout_s=30.0, **options))
    workers = []
    if rank == 0:
        workers = [
            ModuleWeightReceiver(sliced_model(full, 0, 2), name="tp0", sliced=True),
            Garbled(sliced_model(full, 1, 2), name="tp1", sliced=True),
        ]
        for w in workers:  # start from other values than the trainer's
            with torch.no_grad():
                for p in w.receiver.model.parameters():
                    p.zero_()
    sync.connect({w.engine_name: LocalEndpoint(w, name=w.engine_name) for w in workers})
    out: dict = {}
    start = time.monotonic()
    try:
        sync.sync("v1")
    except Exception as exc:  # every rank raises: rank 0 what failed, the others that it did
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["failed_s"] = time.monotonic() - start
    if rank == 0:
        out["versions"] = [w.weight_version() for w in workers]
        workers[1].garbled = False
    report = sync.sync("v2")
    if rank == 0:
        assert report is not None and report.verify is not None
        out["v2"] = {n: report.verify[n].to_dict() for n in ("tp0", "tp1")}
        out["v2_versions"] = [w.weight_version() for w in workers]
        out["w1"] = torch.equal(workers[1].receiver.model.w1, full.w1.detach()[:, 3:])
    else:
        out["v2"] = report
    sync.close()
    results.put((rank, out))
    close_trainer_group()


def _two_ranks(target, *args) -> dict:
    """`target(rank, port, results, *args)` in two spawned processes: {rank: what it put}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results, *args)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_a_tp_engines_first_verified_sync_fails_before_commit_on_every_rank():
    got = _two_ranks(_rank, {})
    zero, one = got[0], got[1]
    # Rank 0 raises what failed: the worker and parameter, before the engine adopted the update.
    assert zero["error"].startswith("VerificationFailed: verification failed, update 'v1' aborted")
    assert "'tp1': ['worker 0: w2']" in zero["error"], zero["error"]
    assert zero["versions"] == [None, None]  # neither worker committed v1
    # Rank 1 learns it from rank 0 at once, not after its 30 s deadline.
    assert one["error"].startswith("RuntimeError: rank 0 failed this sync: VerificationFailed")
    assert one["failed_s"] < 20, one
    # The next sync, its placements known from the start, is checked worker by worker.
    for name in ("tp0", "tp1"):
        assert zero["v2"][name]["verified"] and zero["v2"][name]["num_checked"] == 4, zero["v2"]
        assert not zero["v2"][name].get("pending")
    assert zero["v2_versions"] == ["v2", "v2"] and zero["w1"]
    assert one["v2"] is None


def _slow_rank(rank: int, port: int, results, slow_s: float, timeout_s: float) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import SyncOptions, TrainerSync
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import close_trainer_group, init_trainer_group

    class Slow(ModuleWeightReceiver):
        """An engine whose `stage` and `end` each take `slow_s`: within the sync's timeout
        one at a time, beyond it together."""

        def _engine_stage(self):
            time.sleep(slow_s)
            return super()._engine_stage()

        def _engine_end(self, version):
            time.sleep(slow_s)
            return super()._engine_end(version)

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sync = TrainerSync(model, options=SyncOptions(verify=True, timeout_s=timeout_s))
    engines = {}
    if rank == 0:
        slow = Slow(_model(), name="slow")
        engines = {"slow": LocalEndpoint(slow, name="slow")}
    sync.connect(engines)
    out: dict = {}
    start = time.monotonic()
    try:
        report = sync.sync("v1")
        out["verified"] = None if report is None else report.verify["slow"].verified
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    out["sync_s"] = time.monotonic() - start
    sync.close()
    results.put((rank, out))
    close_trainer_group()


def test_a_verified_sync_longer_than_the_timeout_passes_where_each_engine_call_is_within_it():
    """The other ranks wait for rank 0's checks and `end` in a collective bounded by the sync's
    timeout; rank 0 tells them the sync goes on between two engine calls, so an engine whose
    `stage` and `end` each take 60% of the timeout (1.2 times it together) passes on every
    rank, instead of failing the others at the timeout."""
    got = _two_ranks(_slow_rank, 3.0, 5.0)
    assert got[0].get("verified") is True, got
    assert "error" not in got[1] and got[1]["sync_s"] > 6.0, got
