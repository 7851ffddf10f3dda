"""A whole sync through the core: sender, shared memory, a module receiver, verification."""

from __future__ import annotations

import pytest
import torch

from weightsync.apps.models import build_model
from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.sender import WeightSender
from weightsync.trainer.source import DTensorV2Source
from weightsync.transports.shm import ShmSender
from weightsync.wire.errors import BucketRejected
from weightsync.wire.fingerprint import fingerprint


def _pair(arch="opt", capacity_bytes=1 << 16):
    trainer = build_model(arch, "tiny", seed=1)
    engine_model = build_model(arch, "tiny", seed=2)
    receiver = ModuleWeightReceiver(engine_model, name="ref")
    source = DTensorV2Source(trainer)
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=capacity_bytes)
    return trainer, engine_model, receiver, source, sender


def test_sync_makes_engine_weights_equal_and_verifies():
    trainer, engine_model, receiver, source, sender = _pair()
    try:
        sender.add_engine(LocalEndpoint(receiver, name="ref"))
        report = sender.sync(source.tensors(), version="v1", verify=True)
    finally:
        sender.close()
    assert report.num_buckets > 3
    assert report.verify["ref"].verified, report.verify
    assert receiver.weight_version() == "v1"
    want = trainer.state_dict()
    for name, tensor in engine_model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_unchanged_buckets_are_replayed_and_still_carry_each_syncs_values():
    """From the second sync each bucket is announced as "same" (no tensor list): the receiver
    reuses its views and copy lists and still loads the new bytes; a receiver that never saw a
    bucket refuses "same" before reading anything, and after `forget_replays` every bucket is
    described in full again."""
    trainer, engine_model, receiver, source, sender = _pair()
    handles = _recording(sender)
    try:
        sender.add_engine(LocalEndpoint(receiver, name="ref"))
        for version in ("v1", "v2", "v3"):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.5)  # new values every sync
            report = sender.sync(source.tensors(), version=version, verify=True)
            assert report.verify["ref"].verified, report.verify
        buckets = report.num_buckets
        same = [bool(h.get("same")) for h in handles]
        assert len(same) == 3 * buckets and not any(same[:buckets])
        # The second sync describes again the buckets whose slot grew during the first.
        assert any(same[buckets : 2 * buckets]) and all(same[2 * buckets :])
        assert all(
            torch.equal(t, trainer.state_dict()[n]) for n, t in engine_model.state_dict().items()
        )
        other = ModuleWeightReceiver(build_model("opt", "tiny", seed=3), name="other")
        other.check_refit([s.to_dict() for s in source.specs()])
        other.begin("x")
        same = {"index": 0, "nbytes": 16, "tensors": [], "handle": {**handles[-1], "same": True}}
        with pytest.raises(BucketRejected, match="holds no views"):
            other.load_bucket(same)
        handles.clear()
        sender.transport.forget_replays()
        sender.sync(source.tensors(), version="v4")
        assert not any(h.get("same") for h in handles)
    finally:
        sender.close()


def _recording(sender):
    """The handles `sender` describes its buckets with, as a list it appends to."""
    handles = []
    describe = sender.transport.describe
    sender.transport.describe = lambda slot, index: (
        handles.append(describe(slot, index)) or (handles[-1])
    )
    return handles


def test_trainers_taking_turns_on_one_engine_replay_only_after_their_own_update():
    """Three trainers take turns on one engine, more segments than its receiver keeps mapped
    (the first trainer's views are dropped): after another trainer's update the engine's
    `begin` says so and the first trainer describes every bucket in full (a "same" would be
    refused); after its own update it replays again. Every sync is verified."""
    engine_model = build_model("opt", "tiny", seed=2)
    receiver = ModuleWeightReceiver(engine_model, name="ref")
    trainers = [build_model("opt", "tiny", seed=10 + i) for i in range(3)]
    senders = [
        WeightSender(DTensorV2Source(t).specs(), transport=ShmSender(), capacity_bytes=1 << 16)
        for t in trainers
    ]
    handles = [_recording(s) for s in senders]
    try:
        for sender in senders:
            sender.add_engine(LocalEndpoint(receiver, name="ref"))

        def sync(i, version):
            handles[i].clear()
            report = senders[i].sync(
                DTensorV2Source(trainers[i]).tensors(), version=version, verify=True
            )
            assert report.verify["ref"].verified, report.verify
            want = trainers[i].state_dict()
            assert all(torch.equal(t, want[n]) for n, t in engine_model.state_dict().items())
            return [bool(h.get("same")) for h in handles[i]]

        sync(0, "a1")
        assert any(sync(0, "a2"))  # its own update came last: replayed
        for i, version in ((1, "b1"), (2, "c1")):
            assert not any(sync(i, version))
        assert not any(sync(0, "a3"))  # the others came between: everything in full
        assert all(sync(0, "a4"))
    finally:
        for sender in senders:
            sender.close()


def test_verification_catches_an_engine_weight_that_differs():
    trainer, engine_model, receiver, source, sender = _pair()
    try:
        sender.add_engine(LocalEndpoint(receiver, name="ref"))
        sender.sync(source.tensors(), version="v1")
        with torch.no_grad():
            engine_model.model.decoder.layers[1].fc1.weight[3, 3] += 1
        sent = {n: fingerprint(t) for n, t in source.tensors()}
        result = sender.verify(sent, engines=["ref"])
    finally:
        sender.close()
    assert not result["ref"].verified
    assert result["ref"].mismatched == ["model.decoder.layers.1.fc1.weight"]


def test_shape_mismatch_is_rejected_before_any_weight_changes():
    trainer = build_model("opt", "small", seed=1)
    engine_model = build_model("opt", "tiny", seed=2)
    before = {k: v.clone() for k, v in engine_model.state_dict().items()}
    receiver = ModuleWeightReceiver(engine_model, name="ref")
    sender = WeightSender(
        DTensorV2Source(trainer).specs(), transport=ShmSender(), capacity_bytes=1 << 16
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"tensor 'model.decoder.embed_tokens.weight' "
            r"\(trainer shape \(320, 512\).*\(320, 256\)",
        ):
            sender.add_engine(LocalEndpoint(receiver, name="ref"))
    finally:
        sender.close()
    for name, tensor in engine_model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_dtype_mismatch_names_both_dtypes():
    trainer = build_model("opt", "tiny", seed=1)
    engine_model = build_model("opt", "tiny", seed=2).to(torch.bfloat16)
    receiver = ModuleWeightReceiver(engine_model, name="ref")
    sender = WeightSender(
        DTensorV2Source(trainer).specs(), transport=ShmSender(), capacity_bytes=1 << 16
    )
    try:
        with pytest.raises(ValueError, match="trainer dtype float32 != engine dtype bfloat16"):
            sender.add_engine(LocalEndpoint(receiver, name="ref"))
    finally:
        sender.close()


def test_unknown_name_is_rejected():
    trainer = build_model("gpt2", "tiny", seed=1)
    engine_model = build_model("opt", "tiny", seed=2)
    receiver = ModuleWeightReceiver(engine_model, name="ref")
    sender = WeightSender(
        DTensorV2Source(trainer).specs(), transport=ShmSender(), capacity_bytes=1 << 16
    )
    try:
        with pytest.raises(ValueError, match=r"no parameter for \d+ trainer tensor.*transformer"):
            sender.add_engine(LocalEndpoint(receiver, name="ref"))
    finally:
        sender.close()
