from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from weightsync.bucket import fill_buckets, plan_buckets, unpack
from weightsync.fingerprint import fingerprint
from weightsync.transports import make_receiver
from weightsync.transports.collective import CollectiveSender
from weightsync.wire import BucketDescriptor, TensorSpec


def _receiver_process(requests, replies):
    receiver = make_receiver("gloo")
    while (item := requests.get()) is not None:
        desc = BucketDescriptor.from_dict(item)
        views = unpack(receiver.receive(desc.handle, desc.nbytes), desc)
        replies.put({name: fingerprint(view) for name, view in views})
    receiver.close()


def test_gloo_broadcast_reaches_two_receiving_processes():
    g = torch.Generator().manual_seed(2)
    tensors = [(f"w{i}", torch.randn(64 + i, 9, generator=g)) for i in range(12)]
    plans = plan_buckets([TensorSpec.of(n, t) for n, t in tensors], capacity_bytes=8192)
    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    children = [ctx.Process(target=_receiver_process, args=q) for q in queues]
    for child in children:
        child.start()
    sender = CollectiveSender(num_receivers=2, backend="gloo", timeout_s=60)
    got: list[dict] = [{}, {}]
    try:
        for plan in fill_buckets(plans, iter(tensors),
                                 lambda p: sender.buffer(p.index % 2, p.nbytes)):
            desc = plan.descriptor(sender.handle(plan.index % 2)).to_dict()
            for requests, _ in queues:
                requests.put(desc)
            sender.send(plan.index % 2, plan.nbytes)
            for i, (_, replies) in enumerate(queues):
                got[i].update(replies.get(timeout=60))
        for requests, _ in queues:
            requests.put(None)
    finally:
        sender.close()
        for child in children:
            child.join(timeout=30)
    want = {name: fingerprint(t) for name, t in tensors}
    assert got[0] == want and got[1] == want


def test_bad_backend_and_receiver_count_are_rejected():
    with pytest.raises(ValueError, match="backend 'mpi'"):
        CollectiveSender(num_receivers=1, backend="mpi")
    with pytest.raises(ValueError, match="num_receivers=0"):
        CollectiveSender(num_receivers=0)
