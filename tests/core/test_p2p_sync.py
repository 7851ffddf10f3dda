"""`TrainerSync(point_to_point=True)`: after a first sync by buckets, every trainer rank sends the
pieces of its own shards straight to the engine workers that keep them (weightsync/trainer/
p2p_path.py). Real 2-process gloo FSDP2 trainer (a tiny Qwen2: rope, GQA, untied head); three
reference receivers in rank 0's process: one whole copy and two tensor-parallel workers whose
slicing loaders keep rows or columns (tests/core/test_placement.py `sliced_model`). Every sync is
checked worker by worker, and rank 0's bytes are recounted from the shards' rows and the slicing
rule, independently of the planner."""

from __future__ import annotations

import multiprocessing as mp

import torch

from tests.conftest import free_port

SEED = 11


def sliced_model(full: torch.nn.Module, rank: int, size: int) -> torch.nn.Module:
    """A tensor-parallel worker's copy of `full` (as tests/core/test_placement.py's, for nested
    names): every 2-D weight cut along dim 0 (even positions) or dim 1 (odd ones), the rest
    whole, each parameter's loader keeping this rank's slice."""
    import copy

    model = copy.deepcopy(full)
    for i, (name, p) in enumerate(list(full.named_parameters())):
        dim = i % 2 if p.dim() == 2 else 0
        shape = list(p.shape)
        if p.dim() == 2:
            shape[dim] //= size
        param = torch.nn.Parameter(torch.zeros(shape, dtype=p.dtype), requires_grad=False)

        cut = p.dim() == 2

        def loader(param, tensor, dim=dim, cut=cut):
            n = param.shape[dim]
            param.data.copy_(tensor.narrow(dim, rank * n, n) if cut else tensor)

        param.weight_loader = loader  # type: ignore[attr-defined]
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, param)
    return model


def _kept_of_rank0(full: torch.nn.Module, rows0: dict[str, int]) -> int:
    """Bytes the three workers keep of rank 0's shards: the whole worker all of them; a TP
    worker the elements of its slice (`sliced_model`'s rule: 2-D tensors cut along dim 0 or 1
    by position, the rest whole) that lie in rank 0's rows."""
    total = 0
    for i, (name, p) in enumerate(full.named_parameters()):
        idx = torch.arange(p.numel()).view(p.shape)
        stop = rows0[name] * (p.numel() // p.shape[0])
        total += stop * p.element_size()  # the whole worker
        dim = i % 2 if p.dim() == 2 else 0
        for r in range(2):
            n = p.shape[dim] // 2
            kept = idx.narrow(dim, r * n, n) if p.dim() == 2 else idx
            total += int((kept < stop).sum()) * p.element_size()
    return total


def _rank(rank: int, port: int, results) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    class Garbled(ModuleWeightReceiver):
        """A worker whose bytes of one parameter differ from what was sent, once received
        (as a bad transfer would leave them), while `garbled` is set."""

        garbled = False

        def _engine_p2p_receive(self):
            report = super()._engine_p2p_receive()
            if self.garbled:
                with torch.no_grad():
                    self.receiver.model.model.norm.weight.add_(1.0)
            return report

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    full = build_model("qwen2", "tiny", seed=SEED)
    model = shard_model(build_model("qwen2", "tiny", seed=SEED), device="cpu")
    options = SyncOptions(point_to_point=True, bucket_bytes=1 << 16, timeout_s=60.0)
    out: dict = {}
    plain = ModuleWeightReceiver(build_model("qwen2", "tiny", seed=1), name="plain")
    for name, opts in (  # refused at connect (rank 0), before anything is written
        ("plain", options),
        ("cast", SyncOptions(point_to_point=True, sync_dtype="bfloat16")),
    ):
        refusing = TrainerSync(model, options=opts)
        try:
            refusing.connect({"plain": LocalEndpoint(plain, name="plain")})
        except ValueError as exc:
            out[f"refused_{name}"] = str(exc)
        refusing.close()
    sync = TrainerSync(model, options=options)
    engines = {}
    if rank == 0:
        engines = {
            "whole": ModuleWeightReceiver(build_model("qwen2", "tiny", seed=99), sliced=True),
            "tp0": ModuleWeightReceiver(sliced_model(full, 0, 2), name="tp0", sliced=True),
            "tp1": Garbled(sliced_model(full, 1, 2), name="tp1", sliced=True),
        }
    sync.connect({n: LocalEndpoint(e, name=n) for n, e in engines.items()})
    reports = [sync.sync("v1", verify=True), sync.sync("v2", verify=True)]
    with torch.no_grad():  # a training step's worth of change, on every rank's shards
        for param in model.parameters():
            param.to_local().mul_(1.5).add_(0.01)
    reports.append(sync.sync("v3"))
    out["verify_v3"] = sync.verify()
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().mul_(-0.5)
    reports.append(sync.sync("v4", verify=True))
    if rank == 0:
        engines["tp1"].garbled = True
    try:  # every rank raises: rank 0 what failed, the others that it did
        sync.sync("v5", verify=True)
    except Exception as exc:
        out["garbled_error"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        out["versions_after_garbled"] = {n: e.weight_version() for n, e in engines.items()}
        engines["tp1"].garbled = False
    reports.append(sync.sync("v6", verify=True))
    tensors = dict(sync.source.tensors())  # the trainer's weights now (every rank gathers)
    if rank == 0:
        out["reports"] = reports
        out["num_planned"] = sync.p2p_path.num_planned if sync.p2p_path else None
        out["whole_equal"] = all(
            torch.equal(p, tensors[n])
            for n, p in engines["whole"].receiver.model.named_parameters()
        )
        out["tp_equal"] = True
        for r in (0, 1):
            want = dict(sliced_model(full, r, 2).named_parameters())
            for n, p in want.items():  # the slicing loader applied to the trainer's tensor
                p.weight_loader(p, tensors[n])  # type: ignore[operator]
            got = dict(engines[f"tp{r}"].receiver.model.named_parameters())
            out["tp_equal"] &= all(torch.equal(got[n], want[n]) for n in want)
        rows0 = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        out["kept_of_rank0"] = _kept_of_rank0(full, rows0)
        out["kept"] = sum(
            p.numel() * p.element_size()
            for e in engines.values()
            for p in e.receiver.model.parameters()
        )
    sync.close()
    results.put((rank, out))
    close_trainer_group()


def test_each_rank_sends_its_own_shards_to_the_workers_that_keep_them_verified():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    out = got[0]
    assert "engine 'plain' cannot take the point-to-point path" in out["refused_plain"]
    assert "learns no placements" in out["refused_plain"]
    assert "point_to_point=True: some tensors reach the engines converted" in out["refused_cast"]
    first, *p2p = out["reports"]
    assert first.path == "buckets" and first.verify.verified
    assert [r.path for r in p2p] == ["p2p"] * 4
    for report in (p2p[0], p2p[2], p2p[3]):
        assert report.verify.verified, report.verify
        for name in ("whole", "tp0", "tp1"):
            assert report.verify[name].num_checked > 0 and not report.verify[name].pending
    assert out["verify_v3"].verified  # an unverified p2p sync, checked afterwards
    assert out["whole_equal"] and out["tp_equal"]
    # Each rank hashed the pieces it sent: a worker whose bytes differ fails the sync before
    # any engine adopts it, on every rank, naming the worker's parameter.
    assert out["garbled_error"].startswith("VerificationFailed: verification failed, update 'v5'")
    assert "'tp1': ['worker 0: model.norm.weight']" in out["garbled_error"], out["garbled_error"]
    assert out["versions_after_garbled"] == {"whole": "v4", "tp0": "v4", "tp1": "v4"}
    assert got[1]["garbled_error"].startswith("RuntimeError: rank 0 failed this sync")
    # Planned once for the three engines; after the failed sync, again (its group is rebuilt).
    assert out["num_planned"] == 2
    # Every byte the workers keep came from the rank that holds it: rank 0 sent exactly the
    # kept bytes of its own rows, rank 1 the rest.
    kept = out["kept"]
    for report in p2p:
        assert report.rank_bytes[0] == out["kept_of_rank0"]
        assert sum(report.rank_bytes) == report.bytes_written == kept
        assert 0 < report.rank_bytes[0] < kept
    assert got[1]["verify_v3"] is None


def _failing_rank(rank: int, port: int, results) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    class Lost(ModuleWeightReceiver):
        """A worker whose point-to-point messages never arrive (a trainer rank's link gone):
        its receive fails before it writes anything."""

        def _engine_p2p_receive(self):
            def lost():
                raise TimeoutError("a trainer rank's message never came")

            self.inbox.p2p.receive_buffers = lost  # type: ignore[union-attr]
            return super()._engine_p2p_receive()

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("qwen2", "tiny", seed=SEED), device="cpu")
    sync = TrainerSync(model, options=SyncOptions(point_to_point=True, timeout_s=5.0))
    engine = Lost(build_model("qwen2", "tiny", seed=99), name="lost", sliced=True)
    sync.connect({"lost": LocalEndpoint(engine, name="lost")} if rank == 0 else {})
    first = sync.sync("v1")
    out: dict = {"paths": [first.path if first is not None else None], "errors": []}
    for version in ("v2", "v3"):
        try:
            sync.sync(version)
        except Exception as exc:  # every rank raises
            out["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
        if rank == 0:  # nothing was written: the engine serves its last version
            engine.check_serving()
            out.setdefault("versions", []).append(engine.weight_version())
    report = sync.sync("v4", verify=True)
    if rank == 0:
        out["paths"].append(report.path)
        out["verified"] = report.verify.verified
    sync.close()
    results.put((rank, out))
    close_trainer_group()


def test_a_receive_that_fails_before_writing_leaves_the_engine_serving_then_buckets_take_over():
    """A point-to-point receive that fails before it wrote anything (no message came) fails
    the sync on every rank but leaves the engine serving its last version; after two such
    syncs in a row the engine keeps buckets, and the next sync passes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_failing_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    zero, one = got[0], got[1]
    assert zero["paths"] == ["buckets", "buckets"] and zero["verified"]
    assert zero["versions"] == ["v1", "v1"]
    assert len(zero["errors"]) == len(one["errors"]) == 2, (zero, one)
    assert all("point-to-point" in e or "lost" in e for e in zero["errors"]), zero["errors"]
    assert all(e.startswith("RuntimeError: rank 0 failed this sync") for e in one["errors"])
