from __future__ import annotations

import multiprocessing as mp
import os
import stat
import subprocess
import sys

import torch

from weightsync.bucket import fill_buckets, plan_buckets
from weightsync.fingerprint import fingerprint
from weightsync.transports.shm import ShmReceiver, ShmSender, list_segments, sweep_stale_segments
from weightsync.wire import BucketDescriptor, TensorSpec


def _receiver_process(requests, replies):
    """Another process: maps each bucket, answers {name: fingerprint}."""
    from weightsync.bucket import unpack

    receiver = ShmReceiver()
    while (item := requests.get()) is not None:
        desc = BucketDescriptor.from_dict(item)
        views = unpack(receiver.receive(desc.handle, desc.nbytes), desc)
        replies.put({name: fingerprint(view) for name, view in views})
        del views
    receiver.close()
    replies.put("closed")


def test_buckets_cross_to_another_process_intact():
    g = torch.Generator().manual_seed(1)
    tensors = [(f"layer.{i}", torch.randn(100 + i, 7, generator=g).bfloat16()) for i in range(20)]
    plans = plan_buckets([TensorSpec.of(n, t) for n, t in tensors], capacity_bytes=4096)
    assert len(plans) > 2
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_process, args=(requests, replies))
    child.start()
    sender = ShmSender(num_slots=2)
    got = {}
    try:
        for plan in fill_buckets(plans, iter(tensors),
                                 lambda p: sender.buffer(p.index % 2, p.nbytes)):
            requests.put(plan.descriptor(sender.handle(plan.index % 2)).to_dict())
            got.update(replies.get(timeout=60))
        requests.put(None)
        assert replies.get(timeout=60) == "closed"
    finally:
        sender.close()
        child.join(timeout=30)
    assert got == {name: fingerprint(t) for name, t in tensors}


def test_segments_are_owner_only_and_unlinked_on_close():
    sender = ShmSender(num_slots=2)
    sender.buffer(0, 1000)
    name = sender.handle(0)["name"]
    mode = os.stat(f"/dev/shm/{name}").st_mode
    assert stat.S_IMODE(mode) == 0o600
    sender.close()
    assert name not in list_segments()


def test_segments_of_a_crashed_sender_are_swept():
    code = ("import os; from weightsync.transports.shm import ShmSender; "
            "s = ShmSender(); s.buffer(0, 4096); print(s.handle(0)['name'], flush=True); "
            "os._exit(9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert name in list_segments()
    assert name in sweep_stale_segments()
    assert name not in list_segments()


def test_receiver_reports_a_vanished_segment():
    sender = ShmSender()
    sender.buffer(0, 64)
    handle = sender.handle(0)
    sender.close()
    import pytest

    with pytest.raises(RuntimeError, match="is gone"):
        ShmReceiver().receive(handle, 64)
