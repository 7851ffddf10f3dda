from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from weightsync.transports import make_receiver
from weightsync.transports.collective import CollectiveSender
from weightsync.wire.bucket import fill_buckets, plan_buckets, unpack
from weightsync.wire.errors import CollectiveFailed
from weightsync.wire.fingerprint import fingerprint
from weightsync.wire.specs import BucketDescriptor, TensorSpec


def _refuse(*args, **kwargs):
    raise AssertionError("the collective transport unpickled something from a peer")


def _refuse_unpickling(patch) -> None:
    """Every way torch or the standard library unpickles, replaced by a refusal (the test's
    own multiprocessing queues keep theirs: they bound `pickle.loads` at import)."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    patch(c10d, "_tensor_to_object", _refuse)
    patch(pickle, "loads", _refuse)
    patch(pickle, "Unpickler", _refuse)


def _receiver_process(requests, replies, refuse_pickle=False):
    if refuse_pickle:
        _refuse_unpickling(setattr)
    receiver = make_receiver("gloo")
    while (item := requests.get()) is not None:
        desc = BucketDescriptor.from_dict(item)
        views = unpack(receiver.receive(desc.handle, desc.nbytes), desc)
        replies.put({name: fingerprint(view) for name, view in views})
    receiver.close()


def test_gloo_broadcast_reaches_two_receiving_processes():
    _broadcast_to_two_receivers(refuse_pickle=False)


def test_a_gloo_sync_unpickles_nothing_on_either_side(monkeypatch):
    """The store (counters, strings) and the broadcasts (raw bytes) carry no pickle: the same
    sync passes with unpickling refused in the sender and in both receivers."""
    _refuse_unpickling(monkeypatch.setattr)
    _broadcast_to_two_receivers(refuse_pickle=True)


def _broadcast_to_two_receivers(*, refuse_pickle: bool) -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [(f"w{i}", torch.randn(64 + i, 9, generator=g)) for i in range(12)]
    plans = plan_buckets([TensorSpec.of(n, t) for n, t in tensors], capacity_bytes=8192)
    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    children = [ctx.Process(target=_receiver_process, args=(*q, refuse_pickle)) for q in queues]
    for child in children:
        child.start()
    sender = CollectiveSender(num_receivers=2, backend="gloo", timeout_s=60)
    got: list[dict] = [{}, {}]
    try:
        for plan in fill_buckets(
            plans, iter(tensors), lambda p: sender.buffer(p.index % 2, p.nbytes)
        ):
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


def _timed_receiver_process(requests, replies):
    """Receive each (handle, nbytes) asked for; reply ("ok", s) or (error class, message, s).
    Replies "ready" first, once started (torch imported)."""
    receiver = make_receiver("gloo")
    replies.put("ready")
    while (item := requests.get()) is not None:
        handle, nbytes = item
        start = time.perf_counter()
        try:
            receiver.receive(handle, nbytes)
            replies.put(("ok", "", time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001 - reported to the test process
            replies.put((type(exc).__name__, str(exc), time.perf_counter() - start))
    receiver.close()


@pytest.mark.parametrize("num_sent", [0, 1], ids=["before-the-group-forms", "after-a-bucket"])
def test_a_receive_whose_broadcast_never_comes_fails_within_timeout_s(num_sent):
    """The sender stops sending: before its first bucket (the receiver waits for the group to
    form) or after one (the receiver waits in the broadcast). Either wait ends at `timeout_s`."""
    timeout_s = 4.0
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_timed_receiver_process, args=(requests, replies))
    child.start()
    sender = CollectiveSender(num_receivers=1, backend="gloo", timeout_s=timeout_s)
    try:
        # The group forms within timeout_s only if the receiver is up when the sender sends.
        assert replies.get(timeout=120) == "ready"
        sender.buffer(0, 64).fill_(7)
        for _ in range(num_sent):
            requests.put((sender.handle(0), 64))
            sender.send(0, 64)
            assert replies.get(timeout=60)[0] == "ok"
        requests.put((sender.handle(1), 64))  # announced, never sent
        try:
            outcome, message, waited_s = replies.get(timeout=timeout_s + 60)
        except queue.Empty:
            pytest.fail(f"the receiver still waits {timeout_s + 60:g} s after timeout_s")
        requests.put(None)
    finally:
        sender.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    print(f"{outcome} after {waited_s:.1f} s: {message}")
    assert outcome == "CollectiveFailed"
    assert "4000ms" in message  # the deadline the handle carried, in gloo's / the store's words
    # ... and in ours: the peer waited for, where it listens, what to check.
    assert f"the trainer's gloo sender (rank 0) at 127.0.0.1:{sender.port}" in message
    assert "within 4 s" in message and "SyncOptions.timeout_s" in message
    assert "SyncOptions.collective_host" in message
    assert timeout_s <= waited_s < timeout_s + 5


def test_a_sender_whose_receivers_never_join_fails_within_timeout_s_naming_them():
    sender = CollectiveSender(num_receivers=2, backend="gloo", timeout_s=3.0)
    try:
        sender.buffer(0, 64).fill_(7)
        start = time.perf_counter()
        with pytest.raises(CollectiveFailed) as failure:
            sender.send(0, 64)
        waited_s = time.perf_counter() - start
    finally:
        sender.close()
    message = str(failure.value)
    print(f"after {waited_s:.1f} s: {message}")
    assert (
        f"the 2 engine process(es) of the gloo group at 127.0.0.1:{sender.port} did not "
        f"all join within 3 s" in message
    )
    assert "SyncOptions.collective_host" in message and "SyncOptions.timeout_s" in message
    assert 3.0 <= waited_s < 3.0 + 5


def _gloo_threads() -> int:
    """This process's threads of gloo groups (their work threads and their devices' loops)."""
    import pathlib

    names = []
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return sum(1 for n in names if n.startswith(("pt_gloo", "gloo_tcp")))


def test_a_receiver_lets_go_of_the_groups_of_senders_that_are_gone():
    """An engine reached by one trainer after another (each a new sender, its own group): once
    a sender is gone (its store closed), the receiver joining the next sender's group lets go
    of the gone one's, its threads with it; a group whose sender lives is kept."""
    import gc
    import threading

    receiver = make_receiver("gloo")
    payload = torch.arange(256, dtype=torch.uint8)

    def one_bucket(sender: CollectiveSender) -> None:
        sender.buffer(0, payload.numel()).copy_(payload)
        thread = threading.Thread(target=sender.send, args=(0, payload.numel()))
        thread.start()
        got = receiver.receive(sender.handle(0), payload.numel())
        thread.join(timeout=60)
        assert torch.equal(got, payload)

    live = CollectiveSender(num_receivers=1, backend="gloo", timeout_s=30)
    one_bucket(live)
    threads = []
    try:
        for _ in range(3):
            gone = CollectiveSender(num_receivers=1, backend="gloo", timeout_s=30)
            one_bucket(gone)
            gone.close()  # its trainer went: the store and its group with it
            del gone
            gc.collect()
            threads.append(_gloo_threads())
        one_bucket(live)  # the live sender's group was kept: the next bucket comes through it
        # kept: the live sender's group and the last gone one's (let go at the next join)
        kept = set(receiver._groups)  # type: ignore[attr-defined]
        assert (live.host, live.port) in kept and len(kept) == 2, kept
        # each new sender's group replaced the one gone before it: no growth after the first
        assert threads[0] > 0 and threads[1] == threads[0] == threads[2], threads
    finally:
        live.close()
        receiver.close()
