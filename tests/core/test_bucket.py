from __future__ import annotations

import pytest
import torch

from weightsync.wire.bucket import fill_buckets, plan_buckets, unpack, write_tensor
from weightsync.wire.specs import (
    ALIGNMENT_BYTES,
    BucketDescriptor,
    TensorMeta,
    TensorSpec,
    dtype_from_str,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bf16", torch.randn(3, 5, generator=g).bfloat16()),
        ("b.fp16", torch.randn(7, generator=g).half()),
        ("c.fp32", torch.randn(2, 3, 4, generator=g)),
        ("d.int64", torch.arange(11, dtype=torch.int64)),
        ("e.empty", torch.empty(0, 4)),
        ("f.int8", torch.randint(-100, 100, (13,), generator=g, dtype=torch.int8)),
        ("g.scalar", torch.tensor(3.5)),
        ("h.bool", torch.tensor([True, False, True])),
        ("i.big", torch.randn(1000, generator=g)),
    ]


def _round_trip(tensors, capacity_bytes):
    specs = [TensorSpec.of(n, t) for n, t in tensors]
    plans = plan_buckets(specs, capacity_bytes=capacity_bytes)
    buffers = {}

    def get_buffer(plan):
        buffers[plan.index] = torch.zeros(plan.nbytes, dtype=torch.uint8)
        return buffers[plan.index]

    out = []
    for plan in fill_buckets(plans, iter(tensors), get_buffer):
        out.extend(unpack(buffers[plan.index], plan.descriptor()))
    return plans, out


@pytest.mark.parametrize("capacity_bytes", [64, 256, 1 << 20])
def test_round_trip_preserves_every_tensor_bit_for_bit(capacity_bytes):
    tensors = _tensors()
    _, out = _round_trip(tensors, capacity_bytes)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, out):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_unpacked_tensors_are_views_of_the_buffer():
    buffer = torch.zeros(128, dtype=torch.uint8)
    meta = TensorMeta(name="x", dtype="float32", shape=(4,), offset=64)
    write_tensor(buffer, meta, torch.ones(4))
    desc = BucketDescriptor(index=0, nbytes=128, tensors=[meta])
    ((_, view),) = unpack(buffer, desc)
    buffer[64:68] = 0
    assert view[0].item() == 0.0 and view[1].item() == 1.0


def test_tensor_larger_than_capacity_gets_its_own_bucket():
    specs = [
        TensorSpec(name="small", dtype="float32", shape=(4,)),
        TensorSpec(name="huge", dtype="float32", shape=(1000,)),
        TensorSpec(name="tail", dtype="float32", shape=(4,)),
    ]
    plans = plan_buckets(specs, capacity_bytes=256)
    assert [[m.name for m in p.tensors] for p in plans] == [["small"], ["huge"], ["tail"]]
    assert plans[1].nbytes >= 4000


def test_offsets_are_aligned_and_buckets_bounded():
    specs = [TensorSpec(name=f"t{i}", dtype="bfloat16", shape=(i + 1,)) for i in range(50)]
    plans = plan_buckets(specs, capacity_bytes=512)
    for plan in plans:
        assert plan.nbytes <= 512
        assert all(m.offset % ALIGNMENT_BYTES == 0 for m in plan.tensors)


@pytest.mark.parametrize("capacity", [0, -5, 1.5, None])
def test_bad_capacity_is_rejected_naming_the_value(capacity):
    with pytest.raises(ValueError, match=f"capacity_bytes={capacity!r}"):
        plan_buckets([TensorSpec(name="x", dtype="float32", shape=(1,))], capacity_bytes=capacity)


def test_unknown_dtype_string_is_rejected_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown dtype 'float13'.*bfloat16"):
        dtype_from_str("float13")
    with pytest.raises(ValueError, match="float13"):
        TensorSpec(name="x", dtype="float13", shape=(1,))


def test_metadata_that_does_not_fit_the_buffer_is_rejected():
    buffer = torch.zeros(64, dtype=torch.uint8)
    meta = TensorMeta(name="w", dtype="float32", shape=(32,), offset=0)
    with pytest.raises(ValueError, match=r"'w' spans bytes \[0, 128\)"):
        unpack(buffer, BucketDescriptor(index=0, nbytes=64, tensors=[meta]))
    with pytest.raises(ValueError, match="descriptor says 256 bytes but the buffer holds 64"):
        unpack(buffer, BucketDescriptor(index=0, nbytes=256, tensors=[]))


def test_stream_that_differs_from_the_plan_is_rejected():
    specs = [TensorSpec(name="a", dtype="float32", shape=(2,))]
    plans = plan_buckets(specs, capacity_bytes=1024)
    buf = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"shape \(3,\) != planned \(2,\)"):
        list(fill_buckets(plans, iter([("a", torch.zeros(3))]), lambda p: buf))
    with pytest.raises(ValueError, match="gave 'b' where refit info expects 'a'"):
        list(fill_buckets(plans, iter([("b", torch.zeros(2))]), lambda p: buf))
    with pytest.raises(ValueError, match="'z' beyond its refit info"):
        list(
            fill_buckets(plans, iter([("a", torch.zeros(2)), ("z", torch.zeros(1))]), lambda p: buf)
        )


def test_duplicate_names_are_rejected():
    spec = TensorSpec(name="a", dtype="float32", shape=(2,))
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([spec, spec], capacity_bytes=1024)
