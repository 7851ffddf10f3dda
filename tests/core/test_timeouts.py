"""Deadlines: the defaults users meet, and an engine call that gets no answer failing after
`timeout_s` with an error naming the engine (a real Ray actor that stops answering)."""

from __future__ import annotations

import inspect
import time

import pytest
import ray

from weightsync import SyncOptions
from weightsync.apps.models import build_model
from weightsync.backends.sglang.engine import SglEngineActor
from weightsync.backends.vllm.engine import VllmEngineActor
from weightsync.driver import launcher
from weightsync.engine.module_receiver import ModuleWeightReceiver
from weightsync.engine.session import EngineSession
from weightsync.trainer.endpoint import RayEndpoint
from weightsync.trainer.sender import WeightSender
from weightsync.trainer.source import DTensorV2Source
from weightsync.transports.shm import ShmSender


def _default(func, name: str):
    return inspect.signature(func).parameters[name].default


def test_engine_calls_and_sync_collectives_default_to_a_60_s_deadline():
    assert SyncOptions().timeout_s == 60.0
    sender = WeightSender([], transport=None, capacity_bytes=1 << 16)
    assert sender.timeout_s == sender.calls.timeout_s == 60.0


def test_engines_expire_a_silent_update_after_60_s_by_default():
    assert _default(EngineSession.__init__, "idle_timeout_s") == 60.0
    assert _default(SglEngineActor.__init__, "idle_timeout_s") == 60.0
    assert _default(VllmEngineActor.__init__, "idle_timeout_s") == 60.0


STALL_S = 60.0  # long past the deadline; without one, the sync fails only after it


class StallingReceiver(ModuleWeightReceiver):
    """The reference receiver, except that `load_bucket` answers only after `STALL_S` (an engine
        hung in its loader). Its actor runs three calls at once: two stalled loads (one per slot) and
    the sender's `abort`."""

    def __init__(self) -> None:
        super().__init__(build_model("opt", "tiny", seed=2), name="stalled")

    def load_bucket(self, descriptor: dict) -> dict:
        time.sleep(STALL_S)
        raise RuntimeError(f"load_bucket answered after {STALL_S:g} s")


@pytest.fixture(scope="module")
def ray_job():
    launcher.init_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_an_engine_call_that_gets_no_answer_fails_after_timeout_s_naming_the_engine(ray_job):
    timeout_s = 3.0
    actor = ray.remote(max_concurrency=3)(StallingReceiver).remote()
    source = DTensorV2Source(build_model("opt", "tiny", seed=1))
    sender = WeightSender(
        source.specs(), transport=ShmSender(), capacity_bytes=1 << 16, timeout_s=timeout_s
    )
    try:
        # The first call waits for the actor to start (an interpreter, torch, a model).
        sender.add_engine(RayEndpoint(actor, name="stalled"), timeout_s=300)
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"engine 'stalled' did not answer within 3 s"):
            sender.sync(source.tensors(), version="v1")
        elapsed_s = time.perf_counter() - start
    finally:
        sender.close()
        ray.kill(actor)
    # The sync waits `timeout_s` for the first bucket's load, then aborts the engine's update.
    print(f"failed {elapsed_s:.1f} s after the sync began (timeout_s={timeout_s:g})")
    assert timeout_s <= elapsed_s < timeout_s + 5, elapsed_s
