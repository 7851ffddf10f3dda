"""Verification sees where each element sits: a loader that puts the right values in the wrong
places (a transposed tensor, two swapped rows, q and k swapped inside a fused QKV) fails it.

The engine side is the project's own receiver (ModelReceiver: the refit check, the loading and
the placement learning every engine backend uses) driving an engine-style loader: q, k and v
land in one fused parameter through a `weight_loader(param, tensor, shard)`. The loader behaves
during the first sync (where the placements are learned) and plants its fault afterwards, as a
loader bug or an engine that rewrites a parameter would. Every fault keeps the parameter's
multiset of values, so an order-blind check (the sums the fingerprints were before) passes it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.engine.refit import copy_loader
from weightsync.engine.replica import ModelReceiver
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.sender import WeightSender
from weightsync.trainer.source import DTensorV2Source
from weightsync.transports.shm import ShmSender
from weightsync.wire.errors import VerificationFailed
from weightsync.wire.fingerprint import fingerprint

HEAD = 4  # q, k and v are 4 x 8 each; q and k swap cleanly
SHARDS = {"q": 0, "k": 1, "v": 2}


def _trainer() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, shape in (
        ("q", (HEAD, 8)),
        ("k", (HEAD, 8)),
        ("v", (HEAD, 8)),
        ("w", (6, 6)),
        ("e", (10, 8)),
    ):
        model.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))
    return model


def _engine_receiver(faults: set[str]) -> ModuleWeightReceiver:
    """A receiver whose model fuses q, k, v into `qkv` and whose loaders plant `faults` once
    the set is filled: "transposed" (w), "rows" (rows 2 and 7 of e swapped), "qk" (q's rows
    written where k's go and k's where q's go)."""
    model = torch.nn.Module()
    for name, shape in (("qkv", (3 * HEAD, 8)), ("w", (6, 6)), ("e", (10, 8))):
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))

    def qkv_loader(param: torch.Tensor, tensor: torch.Tensor, shard: str) -> None:
        index = SHARDS[shard]
        if "qk" in faults and shard in ("q", "k"):
            index = 1 - index
        param.data[index * HEAD : (index + 1) * HEAD].copy_(tensor)

    def w_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
        param.data.copy_(tensor.t() if "transposed" in faults else tensor)

    def e_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
        param.data.copy_(tensor)
        if "rows" in faults:
            param.data[[2, 7]] = tensor[[7, 2]]

    model.qkv.weight_loader = qkv_loader
    model.w.weight_loader = w_loader
    model.e.weight_loader = e_loader

    def load_fn(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name in SHARDS:
                model.qkv.weight_loader(model.qkv, tensor, name)
            else:
                param = getattr(model, name)
                param.weight_loader(param, tensor)

    receiver = ModuleWeightReceiver(torch.nn.Module(), name="fused", sliced=True)
    receiver.receiver = ModelReceiver(
        model, load_fn=load_fn, default_loader=copy_loader, name="fused"
    )
    return receiver


@pytest.mark.parametrize("fault,param", [("transposed", "w"), ("rows", "e"), ("qk", "qkv")])
def test_a_loader_that_misplaces_elements_fails_verification(fault, param):
    trainer = _trainer()
    source = DTensorV2Source(trainer)
    faults: set[str] = set()
    receiver = _engine_receiver(faults)
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="engine"))
        report = sender.sync(source.tensors(), version="v1", verify=True)
        first = report.verify["engine"]
        # Placed whole (TP=1): checked from the sent fingerprints, no second pass.
        assert first.verified and not first.pending, first
        assert first.num_checked == 3  # qkv, w, e
        assert sender.engines["engine"].placements[0]["k"][1] == [[HEAD * 8, 0, HEAD * 8, 1, 0, 0]]

        held = dict(receiver.receiver.model.named_parameters())[param].detach().clone()
        faults.add(fault)
        # Staged, verified, failed: the update is aborted before the engine adopts it.
        with pytest.raises(VerificationFailed, match=f"'v2' aborted.*worker 0: {param}") as err:
            sender.sync(source.tensors(), version="v2", verify=True)
        now = dict(receiver.receiver.model.named_parameters())[param].detach()
        assert not torch.equal(now, held)  # the fault moved elements...
        assert torch.equal(now.reshape(-1).sort().values, held.reshape(-1).sort().values)
        checked = err.value.results["engine"]  # ...and verification names the parameter
        assert not checked["verified"] and checked["mismatched"] == [f"worker 0: {param}"]
        assert receiver.weight_version() == "v1"
        # Checked again outside a sync: the same parameter, and only it.
        again = sender.verify({n: fingerprint(t) for n, t in source.tensors()}, engines=["engine"])[
            "engine"
        ]
        assert again.mismatched == [f"worker 0: {param}"] and again.num_checked == 3
    finally:
        sender.close()


@pytest.mark.parametrize("allow_unchecked", [False, True])
def test_a_parameter_whose_loader_does_not_copy_verbatim_fails_verification_unless_allowed(
    allow_unchecked,
):
    """A loader that writes something else than the tensor (here 123.0 everywhere) from the
    first sync gives verification no placement for that parameter: a verified sync fails before
    the engine commits, naming it; a sender that allows partial checks passes the sync with the
    parameter named unchecked, not counted verified."""
    trainer = torch.nn.Module()
    torch.manual_seed(0)
    trainer.register_parameter("a", torch.nn.Parameter(torch.randn(4, 4)))
    trainer.register_parameter("b", torch.nn.Parameter(torch.randn(4, 4)))
    engine = torch.nn.Module()
    for name in ("a", "b"):
        engine.register_parameter(name, torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False))
    engine.b.weight_loader = lambda param, tensor: param.data.fill_(123.0)
    receiver = ModuleWeightReceiver(engine, name="engine", sliced=True)
    source = DTensorV2Source(trainer)
    sender = WeightSender(
        source.specs(),
        transport=ShmSender(),
        capacity_bytes=1 << 10,
        allow_unchecked=allow_unchecked,
    )
    try:
        sender.add_engine(LocalEndpoint(receiver, name="engine"))
        if not allow_unchecked:
            with pytest.raises(VerificationFailed) as err:
                sender.sync(source.tensors(), version="v1", verify=True)
            assert "verification incomplete, update 'v1' aborted" in str(err.value)
            assert "'engine': ['worker 0: b']" in str(err.value)
            assert "SyncOptions(allow_unchecked=True)" in str(err.value)
            assert err.value.results["engine"]["unchecked"] == ["worker 0: b"]
            assert receiver.weight_version() is None
            return
        report = sender.sync(source.tensors(), version="v1", verify=True)
        checked = report.verify["engine"]
        assert checked.num_checked == 1 and checked.unchecked == ["worker 0: b"], checked
        assert report.verify.metrics()["weightsync/engine/num_unchecked"] == 1
        assert report.verify.to_dict()["engine"]["unchecked"] == ["worker 0: b"]
    finally:
        sender.close()


def test_a_receiver_holding_fused_parameters_is_verified_on_every_one_of_them():
    """The project's receiver in an engine's layout (q/k/v, gate/up and each layer's experts
    fused, weightsync/apps/layouts.py `fused`) reports where each tensor lies, so a verified sync
    compares the fused parameters too (nothing unchecked), and a changed element of one is named."""
    from weightsync.apps import layouts
    from weightsync.wire.fingerprint import fingerprint

    shapes = layouts.layout("mla-moe", num_layers=3, num_experts=4, shrink=64)
    params, where = layouts.fused(shapes)
    receiver = ModuleWeightReceiver(layouts.build_module(params), name="fused", fused=where)
    source = DTensorV2Source(layouts.build_module(shapes, fill=True, seed=0))
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 20)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="fused"))
        checked = sender.sync(source.tensors(), version="v1", verify=True).verify["fused"]
        assert checked.verified and not checked.unchecked, checked
        assert checked.num_checked == len(params)
        w13 = "model.layers.1.mlp.experts.w13_weight"
        with torch.no_grad():
            dict(receiver.receiver.model.named_parameters())[w13].view(-1)[5] += 1
        again = sender.verify({n: fingerprint(t) for n, t in source.tensors()}, engines=["fused"])
        assert again["fused"].mismatched == [f"worker 0: {w13}"]
    finally:
        sender.close()


def test_placements_cross_the_wire_until_the_sender_holds_them_whole():
    """An engine's placements are in its `end` report until the sender holds them all (it
    says how many it holds); later syncs leave them out and a verified one checks every
    parameter against the ones held; a new sender (another trainer, a reconnect) gets them
    whole again."""
    from weightsync.apps import layouts

    shapes = layouts.layout("mla-moe", num_layers=2, num_experts=4, shrink=64)
    params, where = layouts.fused(shapes)
    receiver = ModuleWeightReceiver(layouts.build_module(params), name="fused", fused=where)
    source = DTensorV2Source(layouts.build_module(shapes, fill=True, seed=0))
    ends: list[dict] = []

    class Recording(LocalEndpoint):
        def submit(self, method, *args):
            ticket = super().submit(method, *args)
            if method == "end":
                ends.append(ticket[1])
            return ticket

    for _ in range(2):  # two senders, one after the other
        sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 20)
        try:
            sender.add_engine(Recording(receiver, name="fused"))
            sender.sync(source.tensors(), version="v1")
            checked = sender.sync(source.tensors(), version="v2", verify=True)
            assert checked.verify["fused"].verified and not checked.verify["fused"].unchecked
            assert checked.verify["fused"].num_checked == len(params)
            held = sender.engines["fused"].placements
            assert held is not None and len(held[0]) == len(source.specs())
        finally:
            sender.close()
    assert ["placements" in e for e in ends] == [True, False, True, False]
