"""`DTensorV2Source.layout()` before every sync: the model is not walked again while its tensors
are the same objects, and every way a model can change between syncs still shows."""

from __future__ import annotations

import torch
from torch import nn

from weightsync.trainer.source import DTensorV2Source


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)))
    model.register_buffer("steps", torch.zeros(1))
    return model


def _shapes(source: DTensorV2Source) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (shape, _) in source.layout()}


def test_an_unchanged_model_gives_the_same_layout_without_a_state_dict(monkeypatch):
    model = _model()
    source = DTensorV2Source(model)
    first = source.layout()
    calls = []
    original = nn.Module.state_dict
    monkeypatch.setattr(
        nn.Module, "state_dict", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    with torch.no_grad():
        model[0].weight.add_(1.0)  # new values, same tensors: the same layout
    assert source.layout() is first
    assert calls == []
    assert ("steps", ((1,), "float32")) in first


def test_every_change_of_the_models_tensors_shows_in_the_next_layout():
    model = _model()
    source = DTensorV2Source(model)
    assert _shapes(source)["0.weight"] == (3, 4)
    model[0].weight.data = torch.zeros(5, 4)  # the same Parameter, another shape
    assert _shapes(source)["0.weight"] == (5, 4)
    model[0].weight.data = torch.zeros(5, 4, dtype=torch.float64)  # another dtype
    assert dict(source.layout())["0.weight"] == ((5, 4), "float64")
    model[0].weight = nn.Parameter(torch.zeros(6, 4))  # another Parameter in its place
    assert _shapes(source)["0.weight"] == (6, 4)
    model[1][0].extra = nn.Parameter(torch.zeros(7))  # a parameter added to a module
    assert _shapes(source)["1.0.extra"] == (7,)
    model[1].add_module("2", nn.Linear(2, 8))  # a module added
    assert _shapes(source)["1.2.weight"] == (8, 2)
    model[1][0] = nn.Linear(3, 9)  # a module replaced by another of other shapes
    shapes = _shapes(source)
    assert shapes["1.0.weight"] == (9, 3) and "1.0.extra" not in shapes
    del model[1][2]  # a module removed
    assert "1.2.weight" not in _shapes(source)
    model.register_buffer("steps", torch.zeros(2))  # a buffer replaced
    assert _shapes(source)["steps"] == (2,)


def test_each_rank_s_pieces_follow_new_values_and_new_storage_of_the_same_tensors():
    """`ShardPieces` keeps its walk of the model while the tensors are the same: an in-place
    step shows through its views, a tensor given new storage (`.data =`) is walked again."""
    from weightsync.trainer.source import ShardPieces

    model = _model()
    source = DTensorV2Source(model)

    def pieces() -> dict[str, torch.Tensor]:
        return {n: d.clone() for n, d, _ in ShardPieces(source, rank=0) if d is not None}

    first = pieces()
    entries = source._pieces[0][2]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(pieces()["0.weight"], first["0.weight"] + 1)
    assert source._pieces[0][2] is entries  # not walked again
    model[0].weight.data = torch.full((3, 4), 7.0)  # the same Parameter, new storage
    assert torch.equal(pieces()["0.weight"], torch.full((3, 4), 7.0))
    assert source._pieces[0][2] is not entries


def test_kept_bucket_copies_follow_a_parameter_given_new_memory():
    """A rank's copies of each bucket are kept between syncs (`_CopyLists`), but a parameter
    given new memory in place of its old (`param.data = ...`, as `model.to()` does) is read
    from its new memory at the next fill, not from the old one the kept copies pointed at."""
    from types import SimpleNamespace

    from weightsync.trainer.shard_writes import BucketShardWriter
    from weightsync.wire.bucket import plan_buckets, tensor_view

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    source = DTensorV2Source(model)
    group = SimpleNamespace(
        rank=0, world_size=1, broadcast=lambda obj=None: obj, barrier=lambda: None
    )
    writer = BucketShardWriter(source, group, bucket_bytes=1 << 20)  # type: ignore[arg-type]
    (plan,) = plan_buckets(source.specs(), capacity_bytes=1 << 20)
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    transport = SimpleNamespace(handle=lambda slot: {"kind": "test"})

    def fill() -> dict[str, torch.Tensor]:
        writer.sender_hook(transport)(plan, 0, buffer)
        return {m.name: tensor_view(buffer, m).clone() for m in plan.tensors}

    first = fill()
    assert torch.equal(first["0.weight"], model[0].weight.detach())
    with torch.no_grad():
        model[0].weight.add_(1)  # in place: the same memory, new values
    assert torch.equal(fill()["0.weight"], model[0].weight.detach())
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data * 0 + 7  # new memory, same object
    got = fill()
    assert torch.equal(got["0.weight"], torch.full((8, 8), 7.0))
    assert torch.equal(got["1.bias"], model[1].bias.detach())


def test_a_following_rank_plans_the_buckets_again_only_when_the_layout_changed():
    """Ranks > 0 fill the buckets rank 0 planned at connect: they plan them once, not at every
    sync (a TensorSpec per tensor and the plan: most of a following rank's CPU at 70k
    tensors), and again when the model's tensors changed shape."""
    from types import SimpleNamespace

    from weightsync.trainer.shard_writes import BucketShardWriter

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    source = DTensorV2Source(model)
    group = SimpleNamespace(rank=1, world_size=2)
    writer = BucketShardWriter(source, group, bucket_bytes=1 << 20)  # type: ignore[arg-type]
    first = writer._plans()
    with torch.no_grad():
        model[0].weight.add_(1)  # a training step: the same tensors
    assert writer._plans() is first
    model[0].weight.data = torch.zeros(5, 8)  # another shape
    second = writer._plans()
    assert second is not first
    assert {m.name: m.shape for p in second for m in p.tensors}["0.weight"] == (5, 8)
    assert writer._plans() is second


def test_an_fsdp2_model_s_layout_has_each_dtensor_s_global_shape_and_follows_a_new_one():
    """A DTensor's shape is read from its spec (`_shapes`, not `.shape`, ~3 us a tensor): the
    layout still gives every parameter's global shape, and a parameter FSDP2 holds replaced by
    one of another shape shows in the next layout. An unchanged model's layout comes from the
    quick check (each DTensor's spec still has the same `tensor_meta`), and a DTensor whose
    spec was given another shape in place (the same object) shows too."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from tests.conftest import free_port
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )

    init_trainer_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    try:
        model = shard_model(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
        weight = model[0].weight
        assert type(weight) is DTensor
        source = DTensorV2Source(model)
        assert _shapes(source) == {n: tuple(p.shape) for n, p in model.named_parameters()}
        first = source.layout()
        assert source.layout() is first
        spec = model[1].weight._spec
        meta = spec.tensor_meta
        model[1].weight._spec = DTensorSpec(
            spec.mesh,
            spec.placements,
            tensor_meta=TensorMeta(torch.Size([2, 7]), (7, 1), meta.dtype),
        )
        assert _shapes(source)["1.weight"] == (2, 7)
        model[1].weight._spec = spec
        assert _shapes(source)["1.weight"] == (2, 6)
        first = source.layout()
        model[0].weight = nn.Parameter(
            distribute_tensor(torch.zeros(9, 4), weight.device_mesh, weight.placements)
        )
        assert _shapes(source)["0.weight"] == (9, 4)
        assert source.layout() is not first
    finally:
        close_trainer_group()
