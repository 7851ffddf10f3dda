"""One trainer drives an engine at a time: an update belongs to the sender that opened it.
Two real `WeightSender`s (shared memory) and the reference receiver: a trainer whose update is
open (a "zombie" paused mid-sync) keeps it; a second trainer's sync is refused, naming it,
until that update expires; the zombie's late buckets and its abort then touch nothing of the
second trainer's update."""

from __future__ import annotations

import time

import pytest
import torch

from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.trainer.endpoint import LocalEndpoint
from weightsync.trainer.sender import WeightSender
from weightsync.trainer.source import DTensorV2Source
from weightsync.transports.shm import ShmSender
from weightsync.wire.errors import BucketRejected, EngineBusy

IDLE_S = 1.0


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.register_parameter("a", torch.nn.Parameter(torch.randn(8, 8)))
    model.register_parameter("b", torch.nn.Parameter(torch.randn(16)))
    return model


def test_a_second_trainer_is_refused_while_the_first_ones_update_is_open_until_it_expires():
    engine = ModuleWeightReceiver(_model(0), name="engine", idle_timeout_s=IDLE_S)
    zombie_source, source = DTensorV2Source(_model(1)), DTensorV2Source(_model(2))
    zombie = WeightSender(zombie_source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    trainer = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    try:
        zombie.add_engine(LocalEndpoint(engine, name="engine"))
        trainer.add_engine(LocalEndpoint(engine, name="engine"))
        assert zombie.owner != trainer.owner
        # The zombie opens its update and stalls (paused mid-sync).
        engine.begin("zombie-v1", False, zombie.owner)
        with pytest.raises(
            EngineBusy, match=f"update 'zombie-v1' of another trainer \\({zombie.owner}\\)"
        ):
            trainer.sync(source.tensors(), version="t-v1")
        # The refused trainer's abort did not close the zombie's update.
        assert engine._open == "zombie-v1" and engine.weight_version() is None

        time.sleep(IDLE_S + 0.2)  # the zombie's update expires after idle_timeout_s
        report = trainer.sync(source.tensors(), version="t-v1", verify=True)
        assert report.verify is not None and report.verify["engine"].verified

        # The second trainer's next update is open when the zombie wakes up.
        engine.begin("t-v2", False, trainer.owner)
        late = {"index": 0, "nbytes": 0, "handle": {}, "tensors": [], "update": "zombie-v1"}
        with pytest.raises(BucketRejected, match="a bucket of update 'zombie-v1' arrived while"):
            engine.load_bucket(late)
        engine.abort("the zombie gives up", zombie.owner)
        assert engine._open == "t-v2"  # still the second trainer's
        engine.abort("done", trainer.owner)
        assert engine._open is None and engine.weight_version() == "t-v1"
        engine.check_serving()  # nothing of the zombie's reached the weights
    finally:
        zombie.close()
        trainer.close()


def test_the_same_trainer_may_begin_again_over_its_own_unfinished_update():
    engine = ModuleWeightReceiver(_model(0), name="engine")
    source = DTensorV2Source(_model(2))
    trainer = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    try:
        trainer.add_engine(LocalEndpoint(engine, name="engine"))
        engine.begin("lost", False, trainer.owner)  # its end never came (a retry follows)
        report = trainer.sync(source.tensors(), version="retry", verify=True)
        assert report.verify is not None and report.verify["engine"].verified
    finally:
        trainer.close()
