"""CUDA IPC and NCCL transports through the real sender and a receiving process (GPU only;
skipped where there is no GPU, as in CI)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from weightsync.wire.errors import BucketRejected

needs_gpu = pytest.mark.gpu


def _bench():
    # A plain import, so that spawned receiver processes can import it too.
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
    import gpu_bench

    return gpu_bench


@needs_gpu
@pytest.mark.parametrize("zero_copy", [True, False])
def test_cuda_ipc_sync_into_another_process_is_verified(zero_copy):
    result = _bench().run("ipc", 0.5, repeats=1, bucket_bytes=128 << 20, zero_copy=zero_copy)
    assert result["verified"] and result["sync_gbps"] > 0


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_sync_to_another_gpu_is_verified():
    results = _bench().run("nccl", 0.5, repeats=1, bucket_bytes=[128 << 20, 512 << 20])
    assert all(r["verified"] and r["sync_gbps"] > 0 for r in results)


@pytest.fixture
def ipc_pair():
    """A CUDA IPC sender for 4 bf16 tensors of 1 Mi elements (2 per bucket) and a receiver
    process holding parameters of the same names."""
    yield from _ipc_pair(per_bucket=2)


@pytest.fixture
def ipc_pair_one_per_bucket():
    """As `ipc_pair`, one tensor per bucket: 4 buckets through 2 slots."""
    yield from _ipc_pair(per_bucket=1)


def _ipc_pair(per_bucket: int):
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.source import DTensorV2Source
    from weightsync.transports.cuda_ipc import CudaIpcSender

    bench = _bench()
    numel = 1 << 20
    torch.cuda.set_device(0)
    model = bench.source_model(4, numel, 0)
    endpoint, child = bench.start_receiver(0, 4, numel)
    transport = CudaIpcSender(num_slots=2)
    sender = WeightSender(
        DTensorV2Source(model).specs(),
        transport=transport,
        capacity_bytes=per_bucket * numel * 2,
        timeout_s=60,
    )
    sender.add_engine(endpoint)
    params = [layer.weight.detach() for layer in model.layers]
    yield sender, transport, endpoint, params
    bench.stop_receiver(endpoint, child)
    sender.close()


def _named(tensors):
    return iter([(f"layers.{i}.weight", t) for i, t in enumerate(tensors)])


def _verified(report):
    return report.verify["receiver"].verified


@needs_gpu
def test_cuda_ipc_mixed_tensors_and_temporaries_are_verified(ipc_pair):
    sender, transport, endpoint, params = ipc_pair
    assert _verified(sender.sync(_named(params), version="a", verify=True))
    for p in params:
        p.mul_(2)  # the receiver reads the trainer's tensors as they are now
    strided = torch.empty(2 * params[1].numel(), dtype=params[1].dtype, device="cuda")
    strided[::2] = params[1]
    mixed = [params[0].cpu(), strided[::2], params[2].clone(), params[3]]
    assert _verified(sender.sync(_named(mixed), version="b", verify=True))
    # New temporaries every sync: dead storages' exports are forgotten and dropped remotely.
    for i in range(4):
        assert _verified(
            sender.sync(_named([p.clone() for p in params]), version=f"c{i}", verify=True)
        )
    assert len(transport._exports) <= 2 * 4 + 4
    assert endpoint.call("weight_version", timeout_s=30) == "c3"


@needs_gpu
def test_cuda_ipc_replays_unchanged_buckets_and_describes_changed_ones_in_full(ipc_pair):
    sender, transport, endpoint, params = ipc_pair
    assert _verified(sender.sync(_named(params), version="full", verify=True))
    handles = []
    handle = transport.handle
    transport.handle = lambda slot: handles.append(handle(slot)) or handles[-1]
    for p in params:
        p.add_(1)  # in place: the same storages, new values
    assert _verified(sender.sync(_named(params), version="same", verify=True))
    assert [h.get("same") for h in handles] == [True, True]
    assert all("views" not in h for h in handles)
    handles.clear()
    moved = [params[0].clone() * 3] + params[1:]  # bucket 0 now reads a new storage
    assert _verified(sender.sync(_named(moved), version="moved", verify=True))
    assert [bool(h.get("same")) for h in handles] == [False, True]
    handles.clear()
    transport.forget_replays()  # e.g. an engine was added: everything in full once
    assert _verified(sender.sync(_named(moved), version="again", verify=True))
    assert [bool(h.get("same")) for h in handles] == [False, False]
    # A receiver told "same" for a bucket it never saw refuses it before loading anything.
    endpoint.call("begin", "x", timeout_s=30)
    unknown = {
        "index": 7,
        "nbytes": 16,
        "tensors": [],
        "handle": {"kind": "cuda_ipc", "device": 0, "sync": 99, "same": True},
    }
    with pytest.raises(BucketRejected, match="holds no views"):
        endpoint.call("load_bucket", unknown, timeout_s=30)
    endpoint.call("abort", "test", timeout_s=30)


@needs_gpu
def test_cuda_ipc_buffer_buckets_are_replayed_while_their_layout_holds(ipc_pair):
    """Buckets written into the slots' buffers (the trainer's ranks writing their shards) are
    described in full once, then announced as "same": the receiver reuses its views of the
    buffer and its copy lists, and still loads each sync's new bytes."""
    from weightsync.wire.bucket import write_tensor

    sender, transport, endpoint, params = ipc_pair

    def write_bucket(plan, slot, buffer):
        for meta in plan.tensors:
            write_tensor(buffer, meta, params[int(meta.name.split(".")[1])])

    described = []
    describe = transport.describe
    transport.describe = lambda slot, index: (
        described.append(describe(slot, index)) or described[-1]
    )
    for version in ["a", "b", "c"]:
        for p in params:
            p.add_(1)  # new values every sync: a stale replay would fail verification
        report = sender.sync(None, version=version, verify=True, write_bucket=write_bucket)
        assert _verified(report)
    assert [bool(h.get("same")) for h in described] == [False, False, True, True, True, True]
    assert all("key" not in h for h in described[2:])
    described.clear()
    transport.forget_replays()  # e.g. an engine was added: everything in full once
    assert _verified(sender.sync(None, version="d", verify=True, write_bucket=write_bucket))
    assert [bool(h.get("same")) for h in described] == [False, False]
    assert endpoint.call("weight_version", timeout_s=30) == "d"


@needs_gpu
def test_cuda_ipc_slots_are_written_again_only_after_the_receivers_reads(ipc_pair_one_per_bucket):
    """More buckets than slots: the receiver answers each load with an event recorded after its
    reads (not a wait on its CPU), the sender's stream waits for it before writing the slot
    again; every sync's new values arrive, and the update's `end` waits for the last copies."""
    from weightsync.wire.bucket import write_tensor
    from weightsync.wire.fingerprint import fingerprint

    sender, transport, endpoint, params = ipc_pair_one_per_bucket
    answers = []
    released = transport.released
    transport.released = lambda got: answers.append(got) or released(got)

    def write_bucket(plan, slot, buffer):
        for meta in plan.tensors:
            write_tensor(buffer, meta, params[int(meta.name.split(".")[1])])

    for version in ["a", "b", "c"]:
        for p in params:
            p.add_(1)  # new values every sync, through the same two slots
        # unverified: nothing reads the parameters on the receiver before `end` answers
        report = sender.sync(None, version=version, write_bucket=write_bucket)
        assert report.num_buckets == 4
        sent = {f"layers.{i}.weight": fingerprint(p) for i, p in enumerate(params)}
        assert sender.verify(sent, engines=["receiver"])["receiver"].verified
    assert _verified(sender.sync(None, version="d", verify=True, write_bucket=write_bucket))
    assert len(answers) == 4 * 4
    assert all(len(got) == 1 and got[0] and got[0]["done"] for got in answers)
    assert len({got[0]["done"] for got in answers}) == 2  # one event per slot, recorded again


def test_cuda_ipc_same_from_another_sender_is_refused_before_anything_is_read():
    """Replays are kept per sender: a "same" naming a bucket index some other sender described
    gets no views of that sender's (and no CUDA call is made: this runs without a GPU)."""
    from weightsync.transports.cuda_ipc import CudaIpcReceiver
    from weightsync.wire.specs import BucketDescriptor

    receiver = CudaIpcReceiver()
    receiver._replays[("1234.0", 0)] = (16, [("w", torch.zeros(4))], [])
    same = {"kind": "cuda_ipc", "device": 0, "sync": 1, "same": True, "sender": "1234.1"}
    descriptor = BucketDescriptor(index=0, nbytes=16, tensors=[], handle=same)
    with pytest.raises(BucketRejected, match="holds no views"):
        receiver.receive_tensors(descriptor)


@needs_gpu
def test_cuda_ipc_aborted_sync_is_reported_and_the_next_one_works(ipc_pair):
    sender, _, endpoint, params = ipc_pair
    sender.sync(_named(params), version="good")
    bad = params[:3] + [params[3][:-1]]
    with pytest.raises(ValueError, match="shape"):
        sender.sync(_named(bad), version="bad")
    assert endpoint.call("weight_version", timeout_s=30) == "good"
    assert _verified(sender.sync(_named(params), version="again", verify=True))


@needs_gpu
def test_cuda_ipc_view_beyond_its_storage_is_rejected(ipc_pair):
    sender, transport, endpoint, params = ipc_pair
    plan = sender.plans[0]
    transport.attach(0, plan, params[:2])
    handle = transport.handle(0)
    handle["views"][1][1] = params[1].numel()  # starts where the storage ends
    endpoint.call("begin", "x", timeout_s=30)
    with pytest.raises(BucketRejected, match="beyond its storage"):
        endpoint.call("load_bucket", plan.descriptor(handle).to_dict(), timeout_s=30)
    endpoint.call("abort", "test", timeout_s=30)


def test_zero_copy_hooks_pass_tensors_in_place_on_cpu():
    """The sender's `attach` and the receiver's `receive_tensors` hooks (what CUDA IPC's
    zero-copy path uses), with an in-process stand-in that passes tensors by reference."""
    from weightsync import transports
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.sender import WeightSender
    from weightsync.wire.specs import TensorSpec

    passed: dict[int, list[torch.Tensor]] = {}

    class InPlaceSender(transports.SenderTransport):
        kind = "test_in_place"
        takes_tensors = True

        @property
        def num_slots(self):
            return 2

        def buffer(self, slot, nbytes):
            raise AssertionError("a transport that takes tensors is never asked for a buffer")

        def attach(self, slot, plan, tensors):
            passed[slot] = tensors

        def handle(self, slot):
            return {"kind": self.kind, "slot": slot}

        def close(self):
            pass

    class InPlaceReceiver(transports.ReceiverTransport):
        def receive(self, handle, nbytes):
            raise AssertionError("receive_tensors passes the tensors; no bytes are received")

        def receive_tensors(self, descriptor):
            tensors = passed[descriptor.handle["slot"]]
            return [(m.name, t) for m, t in zip(descriptor.tensors, tensors)]

        def close(self):
            pass

    sys.modules[__name__].InPlaceReceiver = InPlaceReceiver
    transports.register_transport(
        "test_in_place", sender=f"{__name__}:InPlaceSender", receiver=f"{__name__}:InPlaceReceiver"
    )
    try:
        g = torch.Generator().manual_seed(3)
        source = {f"w{i}": torch.randn(5 + i, 3, generator=g) for i in range(7)}
        target = torch.nn.Module()
        for name, t in source.items():
            target.register_parameter(
                name, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
            )
        specs = [TensorSpec.of(n, t) for n, t in source.items()]
        sender = WeightSender(specs, transport=InPlaceSender(), capacity_bytes=256)
        sender.add_engine(LocalEndpoint(ModuleWeightReceiver(target), name="local"))
        report = sender.sync(iter(source.items()), version="v1", verify=True)
        assert report.verify["local"].verified
        assert all(torch.equal(getattr(target, n), t) for n, t in source.items())
        with pytest.raises(ValueError, match="beyond its refit info"):
            sender.sync(iter([*source.items(), ("extra", torch.zeros(1))]), version="v2")
    finally:
        del transports._REGISTRY["test_in_place"]


@needs_gpu
def test_one_copy_into_a_gpu_receiver_writes_its_exported_storages():
    """TrainerSync over CUDA IPC, by buckets alone first; then one-copy: the first sync by
    buckets, after which the receiver exports its parameters' CUDA storages; the timed syncs
    write straight into them (the bench refuses any other path), an unverified one after the
    weights were negated is checked by `verify`, and verified ones pass through the write
    plan; no GPU memory is added on either side."""
    import argparse

    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
    import cpu_layout_bench

    args = argparse.Namespace(
        layout="qwen3-30b-a3b",
        layers=2,
        experts=None,
        shrink=8,
        paths=["buckets", "one_copy"],
        repeats=2,
        bucket_mb=64,
        profile=None,
        trace=None,
        device="cuda",
        ranks=1,
        receiver="checkpoint",
        no_shard_writes=False,
    )
    results = cpu_layout_bench.run(args)["paths"]
    # The bucket path first: from the second sync on, the rank's copies into each bucket are
    # one captured graph, and every sync after the weights changed is still checked.
    buckets = results["buckets"]
    assert buckets["unverified_sync_checked"] and buckets["verified"]
    result = results["one_copy"]
    assert result["unverified_sync_checked"] and result["verified"]
    # The timed verified syncs (each checked verified by the bench) ran the plan's fused
    # copy-and-read-back kernel.
    assert result["verified_through_plan"]
    assert all(v <= 1 << 20 for v in result["peak_gpu_growth_bytes"].values()), result


@needs_gpu
def test_checked_copies_copy_and_read_back_every_pair():
    """The fused copy-and-read-back kernel (weightsync/gpu/kernel.py) over copies of several
    chunks, small ones, and the ones it leaves to `copy_` + `torch.equal` (an odd address, a
    dtype conversion): every destination ends up equal to its source, none reported as
    differing, and a second run copies the sources' new values; the same kernel without the
    read-back copies the pairs it can take and refuses the others."""
    from weightsync.gpu import kernel

    if not kernel.available():
        pytest.skip("no Triton")
    dev = torch.device("cuda")
    big = torch.randn(3 * kernel.CHUNK // 4 + 6, device=dev)  # 3 chunks and a bit
    small = torch.randn(5, 8, device=dev, dtype=torch.bfloat16)
    space = torch.zeros(big.numel() + 64, device=dev)
    odd_src = torch.randn(9, device=dev, dtype=torch.bfloat16)
    odd_space = torch.zeros(16, device=dev, dtype=torch.bfloat16)
    converted = torch.randn(12, device=dev)
    pairs = [
        (space[: big.numel()], big),
        (torch.empty_like(small), small),
        (odd_space[1:10], odd_src),
        (torch.empty(12, device=dev, dtype=torch.bfloat16), converted),
    ]
    copies = kernel.CheckedCopies(pairs, dev)
    assert copies.rows == 4 + 1 and copies.others == [2, 3]
    for _ in range(2):
        assert copies.run() == []
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in pairs)
        for _, src in pairs:
            src.mul_(-3)
    assert not torch.equal(pairs[0][0], big)
    # Without the read-back (a write plan's unverified copies): one launch copies them all.
    fused = kernel.Copies(pairs[:2], dev)
    fused.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in pairs[:2])
    with pytest.raises(ValueError, match="2 copies the fused kernel cannot take"):
        kernel.Copies(pairs, dev)


@needs_gpu
def test_a_fused_kernel_that_does_not_run_here_is_not_available(monkeypatch, caplog):
    """`kernel.available()` compiles and runs the kernel once: a kernel that fails there
    (e.g. Triton finds no C compiler for its launcher) makes it false, with the reason logged,
    so write plans keep their CUDA-graph copies and verify piece by piece; the real kernel
    passes the same trial."""
    from weightsync.gpu import kernel

    if not kernel.available():
        pytest.skip("no Triton")

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("Failed to find C compiler. Please specify via CC")

            return launch

    monkeypatch.setattr(kernel, "_kernel", [])
    monkeypatch.setattr(kernel, "_build", lambda: Broken())
    assert not kernel.available()
    assert "does not run here (RuntimeError: Failed to find C compiler" in caplog.text
    with pytest.raises(RuntimeError, match="kernel does not run here"):
        kernel.Copies([], torch.device("cuda"))
    monkeypatch.undo()
    monkeypatch.setattr(kernel, "_kernel", [])
    assert kernel.available()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_an_update_that_keeps_previous_weights_takes_the_one_copy_path_only_on_the_cpu(device):
    """keep_previous on shared CPU parameters: the one-copy update opens (its rollback fences
    the writers off by giving each parameter new memory); on exported CUDA storages it is
    refused with the reason (new memory would leave an engine's CUDA graphs reading the old),
    and the trainer sends that update by buckets. Shared CUDA storages name their GPU."""
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.specs import TensorSpec, specs_to_dicts

    g = torch.Generator().manual_seed(0)
    source = {f"w{i}": torch.randn(4 + i, 3, generator=g) for i in range(3)}
    model = torch.nn.Module()
    for name, t in source.items():
        model.register_parameter(
            name, torch.nn.Parameter(torch.zeros_like(t, device=device), requires_grad=False)
        )
    receiver = ModuleWeightReceiver(model)
    receiver.check_refit(specs_to_dicts([TensorSpec.of(n, t) for n, t in source.items()]))
    shared = receiver.share_params()["shared"]
    try:
        why = receiver.receiver.begin_one_copy(keep_previous=True)
        if device == "cpu":
            assert why is None and "segment" in shared
            receiver.receiver.end_one_copy()
        else:
            assert "keep_previous on GPU parameters" in why, why
            assert shared["cuda"]["uuid"] == str(torch.cuda.get_device_properties(0).uuid)
            assert receiver.receiver.begin_one_copy(keep_previous=False) is None
            receiver.receiver.end_one_copy()
    finally:
        receiver.receiver.close()
