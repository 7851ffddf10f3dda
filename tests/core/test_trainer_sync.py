"""`TrainerSync` and `SyncOptions`: the public trainer-side API, under a real 2-process gloo FSDP2
group, syncing into an in-process reference receiver on rank 0."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from weightsync import SyncOptions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"transport": "tcp"},
            r"SyncOptions.transport='tcp': expected one of \['shm', 'cuda_ipc', "
            r"'gloo', 'nccl'\]",
        ),
        ({"bucket_bytes": 0}, r"SyncOptions.bucket_bytes=0: must be a positive number"),
        ({"bucket_bytes": -5}, r"SyncOptions.bucket_bytes=-5"),
        ({"timeout_s": 0.0}, r"SyncOptions.timeout_s=0.0: must be a positive number"),
        (
            {"one_copy": True, "transport": "gloo"},
            r"SyncOptions.one_copy=True with transport='gloo': the one-copy path needs "
            r"transport='shm' or 'cuda_ipc'",
        ),
        ({"sync_dtype": "float99"}, r"SyncOptions.sync_dtype='float99': not a torch dtype name"),
        ({"switch_lead_s": -0.1}, r"SyncOptions.switch_lead_s=-0.1: must be a number of seconds"),
        ({"switch_lead_s": "1"}, r"SyncOptions.switch_lead_s='1': must be a number of seconds"),
        (
            {"accept_unkept": {"sinks_copy": " "}},
            r"SyncOptions.accept_unkept=\{'sinks_copy': ' '\}: expected \{kind: reason\}",
        ),
        ({"accept_unkept": ["sinks_copy"]}, r"SyncOptions.accept_unkept=\['sinks_copy'\]"),
    ],
)
def test_bad_sync_options_raise_a_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyncOptions(**kwargs)


def test_sync_options_are_frozen():
    options = SyncOptions()
    with pytest.raises(AttributeError):
        options.transport = "gloo"  # type: ignore[misc]


def _collect_logs() -> list[str]:
    """The messages weightsync logs in this process from now on."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("weightsync").addHandler(Collect())
    logging.getLogger("weightsync").setLevel(logging.INFO)
    return records


def _run_two_ranks_of(target, options: dict) -> dict:
    """Run `target(rank, port, results, options)` on 2 spawned ranks; rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results, options)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def _rank_main(rank: int, port: int, results, options: dict) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    records = _collect_logs()
    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    sync = TrainerSync(model, options=SyncOptions(bucket_bytes=1 << 16, **options))
    engine = build_model("opt", "tiny", seed=99) if rank == 0 else None
    endpoint = LocalEndpoint(ModuleWeightReceiver(engine), name="ref") if rank == 0 else None
    out: dict = {"connect": sync.connect({"ref": endpoint} if rank == 0 else {})}
    try:
        sync.sync("v0", engines=["nope"])
    except ValueError as exc:
        out["unknown_engine_error"] = str(exc)
    out["reports"] = [sync.sync("v1", verify=True), sync.sync("v2", verify=True)]
    with torch.no_grad():  # a training step's worth of change, on every rank's shards
        for param in model.parameters():
            param.to_local().mul_(1.5).add_(0.01)
    out["stale"] = sync.verify()
    # Unverified: through each rank's write plan.
    out["reports"].append(sync.sync("v3", verify=False))
    out["fresh"] = sync.verify()
    with torch.no_grad():  # another step: the plan copies again from the same storages
        for param in model.parameters():
            param.to_local().mul_(-0.5)
    out["reports"].append(sync.sync("v4"))  # verified: SyncOptions() verifies by default
    out["fresh_again"] = sync.verify()
    full = dict(sync.source.tensors())
    if rank == 0:
        params = dict(engine.named_parameters())
        out["equal"] = all(torch.equal(params[n], t) for n, t in full.items())
        out["logs"] = records
        results.put(out)
    sync.close()
    close_trainer_group()


def _run_two_ranks(**options) -> dict:
    return _run_two_ranks_of(_rank_main, options)


def test_trainer_sync_takes_buckets_then_the_one_copy_path_and_verifies():
    out = _run_two_ranks()
    assert out["connect"]["ref"].num_params > 0
    assert "unknown engine(s) ['nope']" in out["unknown_engine_error"]
    first, second, third, fourth = out["reports"]
    assert first.path == "buckets" and first.verify["ref"].verified
    assert second.path == "one_copy" and second.verify["ref"].verified
    assert third.path == fourth.path == "one_copy"
    assert third.verify is None  # verify=False
    assert fourth.verify is not None and fourth.verify["ref"].verified  # the default
    # verify() compares the engine with the model as it is now: stale before the sync.
    assert not out["stale"]["ref"].verified and out["stale"]["ref"].mismatched
    for fresh in (out["fresh"], out["fresh_again"]):
        assert fresh["ref"].verified and not fresh["ref"].mismatched
    assert out["equal"]
    _assert_metrics_of_real_syncs(out["reports"])


def _assert_metrics_of_real_syncs(reports: list) -> None:
    """`report.metrics()` of real syncs: one flat dict of plain scalars, what the fields say."""
    metrics = [r.metrics() for r in reports]
    for report, m in zip(reports, metrics):
        odd = {k: type(v).__name__ for k, v in m.items() if type(v) not in (int, float, str)}
        assert not odd, odd
        assert m["weightsync/version"] == report.version
        assert m["weightsync/path"] == report.path
        assert m["weightsync/sync_s"] == report.sync_s > 0
        assert m["weightsync/nbytes"] == report.nbytes > 0
        assert m["weightsync/gbps"] == pytest.approx(report.nbytes / report.sync_s / 1e9)
        assert m["weightsync/ref/end_s"] == report.engines["ref"].end_s
        assert m["weightsync/ref/one_copy"] == int(report.path == "one_copy")
    first, second, third, _ = metrics
    # The first sync, by buckets and verified; then the engine shared its parameters.
    assert first["weightsync/num_buckets"] > 1 and first["weightsync/ref/load_s"] > 0
    assert first["weightsync/ref/share_s"] > 0
    assert first["weightsync/verified"] == first["weightsync/ref/verified"] == 1
    assert first["weightsync/ref/num_checked"] > 0 and first["weightsync/verify_s"] > 0
    assert "weightsync/bytes_written" not in first and "weightsync/phase_write_s" not in first
    # The one-copy path: what the ranks wrote and how long each phase took; no bucket loads.
    assert second["weightsync/num_buckets"] == 0 and "weightsync/ref/load_s" not in second
    assert second["weightsync/bytes_written"] >= second["weightsync/nbytes"]
    for phase in ("begin", "write", "end", "rank_write_max"):
        assert second[f"weightsync/phase_{phase}_s"] >= 0
    assert second["weightsync/ref/verified"] == 1 and second["weightsync/ref/num_mismatched"] == 0
    # Unverified: no verification keys at all.
    assert not [k for k in third if "verif" in k or "num_checked" in k]


def test_trainer_sync_without_one_copy_keeps_buckets_and_says_why_for_a_transport():
    out = _run_two_ranks(one_copy=False)
    assert [r.path for r in out["reports"]] == ["buckets"] * 4
    assert out["fresh"]["ref"].verified and out["equal"]


def test_a_mixed_sync_reports_both_paths_parts():
    from weightsync.trainer.sync import _merge
    from weightsync.wire.protocol import EngineSyncReport, SyncReport

    one_copy = SyncReport(
        version="v2",
        path="one_copy",
        nbytes=100,
        num_buckets=0,
        sync_s=1.0,
        phases_s={"begin": 0.25, "write": 0.5, "end": 0.25, "rank_write": [0.5, 0.25]},
        bytes_written=100,
        engines={"a": EngineSyncReport(path="one_copy", end_s=0.25)},
    )
    buckets = SyncReport(
        version="v2",
        path="buckets",
        nbytes=100,
        num_buckets=2,
        sync_s=1.0,
        engines={"b": EngineSyncReport(path="buckets", load_s=0.5)},
    )
    merged = _merge([one_copy, buckets])
    assert (merged.path, merged.num_buckets, merged.sync_s) == ("mixed", 2, 2.0)
    assert merged.bytes_written == 100 and merged.phases_s == one_copy.phases_s
    metrics = merged.metrics()
    assert metrics["weightsync/bytes_written"] == 100
    assert metrics["weightsync/phase_write_s"] == 0.5
    assert metrics["weightsync/a/one_copy"] == 1 and metrics["weightsync/b/one_copy"] == 0
    assert metrics["weightsync/b/load_s"] == 0.5 and "weightsync/a/load_s" not in metrics


def _construct_only(rank: int, port: int, results, options: dict) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    records = _collect_logs()
    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    sync = TrainerSync(
        shard_model(build_model("opt", "tiny"), device="cpu"), options=SyncOptions(**options)
    )
    if rank == 0:
        results.put({"logs": records, "shard_writes": sync.shard_writes, "one_copy": sync.one_copy})
    sync.close()
    close_trainer_group()


def test_trainer_sync_logs_each_option_it_turns_off_and_why():
    out = _run_two_ranks_of(_construct_only, {"transport": "gloo"})
    assert not out["one_copy"]
    assert "[rank 0] one_copy off: transport 'gloo' has no one-copy path" in out["logs"]
    # gloo keeps shard writes: the ranks' shards reach rank 0 in one gather per bucket.
    assert out["shard_writes"] and not [m for m in out["logs"] if "shard_writes off" in m]


def _fail_then_sync_again(rank: int, port: int, results, options: dict) -> None:
    """An engine fails mid-sync (its second bucket of sync "v2"); then the same trainer syncs
    into a fresh engine. Every rank records what each call did."""
    import time

    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    class FailsMidSync(ModuleWeightReceiver):
        loads = 0

        def load_bucket(self, descriptor: dict) -> dict:
            self.loads += 1
            if self._open == "v2" and self.loads > 1:
                raise RuntimeError("engine failed mid-sync (test)")
            return super().load_bucket(descriptor)

        def begin(self, version: str, one_copy: bool = False, owner: str | None = None) -> dict:
            self.loads = 0
            return super().begin(version, one_copy, owner)

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    sync = TrainerSync(
        model, options=SyncOptions(bucket_bytes=1 << 16, timeout_s=8.0, one_copy=False, **options)
    )
    out: dict = {"rank": rank}
    flaky = LocalEndpoint(FailsMidSync(build_model("opt", "tiny", seed=99)), name="flaky")
    sync.connect({"flaky": flaky} if rank == 0 else {})
    report = sync.sync("v1", verify=True)  # rank 0's report; None on rank 1
    out["v1"] = None if report is None else report.verify["flaky"].verified
    start = time.perf_counter()
    try:
        sync.sync("v2")
        out["v2"] = "ok"
    except Exception as exc:  # noqa: BLE001 - each rank fails in its own way
        out["v2"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out["v2_s"] = time.perf_counter() - start
    fresh_model = build_model("opt", "tiny", seed=98)
    fresh = LocalEndpoint(ModuleWeightReceiver(fresh_model), name="fresh")
    sync.connect({"fresh": fresh} if rank == 0 else {})
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().mul_(1.5).add_(0.01)
    report = sync.sync("v3", verify=True, engines=["fresh"])
    out["v3"] = None if report is None else report.verify["fresh"].verified
    full = dict(sync.source.tensors())
    if rank == 0:
        params = dict(fresh_model.named_parameters())
        out["equal"] = all(torch.equal(params[n], t) for n, t in full.items())
    report = sync.sync("v4", engines=["fresh"])
    out["v4"] = "ok" if report is None else report.version
    results.put(out)
    sync.close()
    close_trainer_group()


def test_after_an_engine_fails_mid_sync_the_same_trainer_syncs_again_into_a_fresh_engine():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_fail_then_sync_again, args=(r, port, results, {})) for r in range(2)
    ]
    for p in procs:
        p.start()
    outs = {}
    for _ in procs:
        out = results.get(timeout=240)
        outs[out["rank"]] = out
    for p in procs:
        p.join(timeout=60)
    print(outs, [p.exitcode for p in procs])
    assert [p.exitcode for p in procs] == [0, 0]
    assert outs[0]["v1"] is True
    assert "engine failed mid-sync" in outs[0]["v2"]
    assert outs[1]["v2"] != "ok"  # rank 1 learns that the sync failed, within the timeout
    assert outs[1]["v2_s"] < 8.0 + 10
    assert outs[0]["v3"] is True and outs[0]["equal"]
    assert outs[0]["v4"] == "v4"


def _finite_rank(rank: int, port: int, results, options: dict) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    big = options.pop("big", False)
    sync = TrainerSync(model, options=SyncOptions(check_finite=True, **options))
    dtype = torch.float16 if big else torch.float32
    engine = (
        ModuleWeightReceiver(build_model("opt", "tiny", seed=99, dtype=dtype))
        if rank == 0
        else None
    )
    sync.connect({"ref": LocalEndpoint(engine, name="ref")} if rank == 0 else {})
    out: dict = {}
    params = dict(model.named_parameters())
    fc1, ln = "model.decoder.layers.1.fc1.weight", "model.decoder.final_layer_norm.bias"
    with torch.no_grad():
        if rank == 1 and big:  # finite in float32, infinite once sent as float16
            params[fc1].to_local()[0, 3] = 1e5
        elif rank == 1:  # only rank 1's shards: rank 0 alone could not see it
            params[fc1].to_local()[0, 3] = float("nan")
            params[ln].to_local()[-1] = float("inf")
    try:
        sync.sync("v1")
    except ValueError as exc:
        out["error"] = str(exc)
    out["version"] = engine.weight_version() if engine else None
    with torch.no_grad():
        for name in (fc1, ln):
            local = params[name].to_local()
            local.copy_(torch.nan_to_num(local, nan=0.5, posinf=0.5).clamp(-9, 9))
    out["report"] = sync.sync("v2")
    if rank == 0:
        results.put(out)
    sync.close()
    close_trainer_group()


def test_check_finite_refuses_a_value_the_sending_dtype_cannot_hold():
    out = _run_two_ranks_of(_finite_rank, {"big": True, "sync_dtype": "float16"})
    assert "1 tensor(s) hold a NaN or an infinity" in out["error"]
    assert "model.decoder.layers.1.fc1.weight" in out["error"]
    assert out["version"] is None
    assert out["report"].engines["ref"].weight_version == "v2"


def test_check_finite_refuses_a_nan_on_any_rank_before_anything_is_written():
    out = _run_two_ranks_of(_finite_rank, {})
    assert out["error"].startswith("sync refused, nothing was written: 2 tensor(s) hold a NaN")
    assert "model.decoder.layers.1.fc1.weight" in out["error"]
    assert "model.decoder.final_layer_norm.bias" in out["error"]
    assert out["version"] is None
    assert out["report"].engines["ref"].weight_version == "v2"


def _grown_rank(rank: int, port: int, results, options: dict) -> None:
    from torch.distributed.tensor import distribute_tensor

    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    sync = TrainerSync(model, options=SyncOptions())
    engine = ModuleWeightReceiver(build_model("opt", "tiny", seed=99)) if rank == 0 else None
    sync.connect({"ref": LocalEndpoint(engine, name="ref")} if rank == 0 else {})
    out: dict = {"first": sync.sync("v1")}  # by buckets; the one-copy path from now on
    fc1 = model.model.decoder.layers[0].fc1
    old = fc1.weight
    grown = torch.zeros(old.shape[0] + 8, old.shape[1])  # a tensor that grew after connect
    fc1.weight = torch.nn.Parameter(distribute_tensor(grown, old.device_mesh, old.placements))
    before = (
        {n: p.detach().clone() for n, p in engine.receiver.model.named_parameters()}
        if (engine)
        else {}
    )
    try:
        sync.sync("v2")
    except ValueError as exc:
        out["error"] = str(exc)
    if engine is not None:
        after = dict(engine.receiver.model.named_parameters())
        out["untouched"] = all(torch.equal(after[n], t) for n, t in before.items())
        out["version"] = engine.weight_version()
        results.put(out)
    sync.close()
    close_trainer_group()


def test_a_tensor_that_changed_shape_after_connect_is_refused_before_any_write():
    out = _run_two_ranks_of(_grown_rank, {})
    assert out["error"].startswith("sync refused, nothing was written: the model's tensors")
    assert (
        "'model.decoder.layers.0.fc1.weight' is float32 (1032, 256), agreed float32"
        in (out["error"])
    )
    assert out["untouched"] and out["version"] == "v1"


def _dying_rank(rank: int, port: int, results, options: dict) -> None:
    from weightsync import SyncOptions, TrainerSync
    from weightsync.apps.models import build_model
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )
    from weightsync.wire.errors import EngineDied

    class DyingEndpoint(LocalEndpoint):
        """An engine whose process goes away once `gone` is set, as a killed Ray actor does
        (`RayEndpoint` raises EngineDied for Ray's actor-died error)."""

        gone = False

        def wait(self, ticket, *, timeout_s: float):
            if self.gone:
                raise EngineDied(f"engine {self.name!r} died: its process is gone", self.name)
            return super().wait(ticket, timeout_s=timeout_s)

    init_trainer_group(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    model = shard_model(build_model("opt", "tiny", seed=3), device="cpu")
    sync = TrainerSync(model, options=SyncOptions(one_copy=False, timeout_s=8.0))
    out: dict = {}
    engines: dict = {}
    if rank == 0:
        dying = DyingEndpoint(ModuleWeightReceiver(build_model("opt", "tiny", seed=9)), name="b")
        keeps = ModuleWeightReceiver(build_model("opt", "tiny", seed=99))
        engines = {"a": LocalEndpoint(keeps, name="a"), "b": dying}
    sync.connect(engines)
    out["first"] = sync.sync("v1")
    if rank == 0:
        dying.gone = True
    try:
        sync.sync("v2")
    except RuntimeError as exc:
        out["died"] = str(exc)
    out["next"] = sync.sync("v3", verify=True)  # the living engine only, saying so
    try:
        sync.sync("v4", engines=["a", "b"])
    except ValueError as exc:
        out["named_dead"] = str(exc)
    if rank == 0:
        results.put(out)
    sync.close()
    close_trainer_group()


def test_an_engine_that_died_is_left_out_of_later_syncs_and_the_report_says_so():
    out = _run_two_ranks_of(_dying_rank, {})
    assert sorted(out["first"].engines) == ["a", "b"]
    assert "engine 'b' died" in out["died"]
    report = out["next"]
    assert sorted(report.engines) == ["a"] and report.verify["a"].verified
    assert report.dropped == {"b": "engine 'b' died: its process is gone"}
    assert report.metrics()["weightsync/num_dropped"] == 1
    assert "engine(s) ['b'] died in an earlier sync" in out["named_dead"]


def test_connect_takes_a_framework_actor_as_plain_data_and_refuses_other_shapes():
    """{"actor": handle, "dispatch": method}: what a driver sends a trainer in another env (no
    weightsync object crosses); anything else shaped like a dict is refused naming the form."""
    from weightsync.trainer.endpoint import RayEndpoint
    from weightsync.trainer.sync import _endpoint

    handle = object()
    plain = _endpoint("rollout-0", {"actor": handle, "dispatch": "weightsync"})
    assert isinstance(plain, RayEndpoint) and plain.actor is handle
    assert (plain.name, plain.dispatch) == ("rollout-0", "weightsync")
    assert _endpoint("e", {"actor": handle}).dispatch is None
    assert _endpoint("e", handle).actor is handle
    with pytest.raises(ValueError, match=r"a plain form is \{\"actor\""):
        _endpoint("e", {"handle": handle})
    with pytest.raises(ValueError, match="dispatch=3 is not a method name"):
        _endpoint("e", {"actor": handle, "dispatch": 3})
