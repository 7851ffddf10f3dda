"""Replayed buckets into an engine-shaped receiver skip the engine's loader where it was seen to
copy verbatim (weightsync/engine/loading.py `BucketLoader.placed`): the first sync goes
through the loader, later syncs copy each tensor along its placement, and the weights are the
same as the loader would have made them."""

from __future__ import annotations

import torch

from weightsync.apps import layouts
from weightsync.engine.loading import PLACED_PATTERNS
from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.sender import WeightSender
from weightsync.trainer.source import DTensorV2Source
from weightsync.transports.shm import ShmSender


def _count_loader_calls(receiver: ModuleWeightReceiver) -> list[int]:
    """Wrap every parameter's `weight_loader` to count its calls (one counter for all)."""
    calls = [0]
    for param in receiver.receiver.model.parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            continue

        def counted(*args, loader=loader):
            calls[0] += 1
            return loader(*args)

        param.weight_loader = counted  # type: ignore[attr-defined]
    return calls


def _fused_setup():
    shapes = layouts.layout("mla-moe", num_layers=3, num_experts=4, shrink=64)
    params, where = layouts.fused(shapes)
    receiver = ModuleWeightReceiver(layouts.build_module(params), name="fused", fused=where)
    trainer = layouts.build_module(shapes, fill=True, seed=0)
    return trainer, receiver, where


def _check_landed(trainer: torch.nn.Module, receiver: ModuleWeightReceiver, where: dict) -> None:
    held = dict(receiver.receiver.model.named_parameters())
    for name, tensor in trainer.state_dict().items():
        pname, start = where[name]
        got = held[pname].detach().reshape(-1)[start : start + tensor.numel()]
        assert torch.equal(got, tensor.reshape(-1)), name


def test_replayed_buckets_into_fused_parameters_call_no_loader_and_land_as_the_loader_did():
    trainer, receiver, where = _fused_setup()
    calls = _count_loader_calls(receiver)
    source = DTensorV2Source(trainer)
    fused_tensors = sum(1 for name in source.layout() if where[name[0]][0] != name[0])
    assert fused_tensors > 10
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=64 << 10)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="fused"))
        counts, handed = [], []
        for i in range(4):
            with torch.no_grad():
                for param in trainer.parameters():
                    param.add_(1.0 + i)
            before = calls[0]
            report = sender.sync(source.tensors(), version=f"v{i}", verify=True)
            assert report.verify["fused"].verified, report.verify
            counts.append(calls[0] - before)
            handed.append(report.engines["fused"].loader_tensors)
            _check_landed(trainer, receiver, where)
        # The first sync's loader calls (each fused tensor at least once, where the refit
        # check found it); fewer in the second (the buckets the sender's slots described
        # before replay), none from the third on (every bucket replays).
        assert counts[0] >= fused_tensors and counts[1] < counts[0], counts
        assert counts[2:] == [0, 0], counts
        # The sync report says so (`EngineSyncReport.loader_tensors`): every tensor handed to
        # the loader at the first sync, none once every bucket replays.
        assert handed[0] == len(source.layout()) and handed[2:] == [0, 0], handed
    finally:
        sender.close()


def test_a_parameter_the_engine_replaced_is_written_in_its_new_place():
    """An engine that registers a new Parameter object (re-packing after loading does) gets the
    next replayed bucket in the new one, not in the one it let go."""
    trainer, receiver, where = _fused_setup()
    source = DTensorV2Source(trainer)
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=64 << 10)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="fused"))
        for version in ("v1", "v2"):
            sender.sync(source.tensors(), version=version)
        model = receiver.receiver.model
        pname = next(p for p, _ in where.values() if p.endswith("w13_weight"))
        prefix, _, key = pname.rpartition(".")
        module = model.get_submodule(prefix)
        old = module._parameters[key]
        new = torch.nn.Parameter(torch.zeros_like(old), requires_grad=False)
        new.weight_loader = old.weight_loader  # type: ignore[attr-defined]
        module._parameters[key] = new
        with torch.no_grad():
            for param in trainer.parameters():
                param.mul_(-1)
        report = sender.sync(source.tensors(), version="v3", verify=True)
        assert report.verify["fused"].verified, report.verify
        _check_landed(trainer, receiver, where)
        assert not torch.equal(old, new)
    finally:
        sender.close()


def test_a_placement_of_many_runs_still_goes_through_the_loader():
    """A transposing loader places each row of its tensor as its own run: more than
    `PLACED_PATTERNS` runs, so a replayed bucket hands that tensor to the loader again, and
    copies the other tensor."""
    torch.manual_seed(0)
    trainer = torch.nn.Module()
    trainer.register_parameter("t", torch.nn.Parameter(torch.randn(6, PLACED_PATTERNS + 4)))
    trainer.register_parameter("w", torch.nn.Parameter(torch.randn(5, 5)))
    engine = torch.nn.Module()
    engine.register_parameter(
        "t", torch.nn.Parameter(torch.zeros(PLACED_PATTERNS + 4, 6), requires_grad=False)
    )
    engine.register_parameter("w", torch.nn.Parameter(torch.zeros(5, 5), requires_grad=False))
    calls = {"t": 0, "w": 0}

    def transposed(param: torch.Tensor, tensor: torch.Tensor) -> None:
        calls["t"] += 1
        param.data.copy_(tensor.t())

    def plain(param: torch.Tensor, tensor: torch.Tensor) -> None:
        calls["w"] += 1
        param.data.copy_(tensor)

    engine.t.weight_loader = transposed  # type: ignore[attr-defined]
    engine.w.weight_loader = plain  # type: ignore[attr-defined]
    receiver = ModuleWeightReceiver(engine, name="sliced", sliced=True)
    source = DTensorV2Source(trainer)
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="sliced"))
        sender.sync(list(source.tensors()), version="v1", verify=True)
        assert len(receiver.receiver.placements["t"][1]) > PLACED_PATTERNS
        assert len(receiver.receiver.placements["w"][1]) == 1
        first = dict(calls)
        with torch.no_grad():
            trainer.t.add_(1.0)
            trainer.w.add_(1.0)
        report = sender.sync(source.tensors(), version="v2", verify=True)
        assert report.verify["sliced"].verified, report.verify
        assert calls["t"] == first["t"] + 1 and calls["w"] == first["w"], (first, calls)
        assert torch.equal(engine.t.detach(), trainer.t.detach().t())
        assert torch.equal(engine.w.detach(), trainer.w.detach())
    finally:
        sender.close()
