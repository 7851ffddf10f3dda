"""Buckets: many named tensors packed into one contiguous byte buffer, and unpacked as views.

The layout is planned from refit info alone (names, dtypes, shapes), before any tensor exists, so
the sender copies each tensor straight into its place as it is gathered and never holds more than
the buckets in flight. A tensor larger than the capacity gets a bucket of its own.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from weightsync.wire.specs import (
    ALIGNMENT_BYTES,
    BucketDescriptor,
    TensorMeta,
    TensorSpec,
    align,
    dtype_from_str,
    dtype_to_str,
)

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(kw_only=True, slots=True)
class BucketPlan:
    """Where each tensor of one bucket goes; `nbytes` is the used (aligned) size."""

    index: int
    nbytes: int
    tensors: list[TensorMeta]
    # (names, shapes, torch dtypes) of `tensors`, for `take_bucket`'s check in bulk
    _expected: tuple[list, list, list] | None = field(default=None, repr=False, compare=False)

    def descriptor(self, handle: dict | None = None) -> BucketDescriptor:
        return BucketDescriptor(
            index=self.index,
            nbytes=self.nbytes,
            tensors=list(self.tensors),
            handle=dict(handle or {}),
        )


def plan_buckets(specs: Iterable[TensorSpec], *, capacity_bytes: int) -> list[BucketPlan]:
    """Lay `specs` out, in order, into buckets of at most `capacity_bytes` each.

    A tensor that alone exceeds the capacity gets a bucket of exactly its (aligned) size.
    """
    if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(
            f"bucket capacity_bytes={capacity_bytes!r}: expected a positive int "
            f"(default {DEFAULT_BUCKET_BYTES})"
        )
    plans: list[BucketPlan] = []
    current: list[TensorMeta] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            plans.append(BucketPlan(index=len(plans), nbytes=used, tensors=current))
        current, used = [], 0

    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice; each name must be sent once")
        seen.add(spec.name)
        size = align(spec.nbytes, ALIGNMENT_BYTES)
        if current and used + size > capacity_bytes:
            close()
        current.append(TensorMeta(name=spec.name, dtype=spec.dtype, shape=spec.shape, offset=used))
        used += size
        if used >= capacity_bytes:
            close()
    close()
    return plans


def write_tensor(buffer: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor) -> None:
    """Copy `tensor` into `buffer` (uint8) at the place `meta` gives, after checking it fits."""
    check_tensor(meta, tensor)
    if meta.offset + meta.nbytes > buffer.numel():
        raise ValueError(
            f"tensor {meta.name!r} needs bytes [{meta.offset}, {meta.offset + meta.nbytes}) "
            f"but the buffer has {buffer.numel()}"
        )
    if meta.nbytes == 0:
        return
    dst = buffer[meta.offset : meta.offset + meta.nbytes].view(tensor.dtype).view(tensor.shape)
    dst.copy_(tensor)


def tensor_view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """A zero-copy view of one tensor inside a uint8 `buffer`."""
    dtype = dtype_from_str(meta.dtype)
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype, device=buffer.device)
    return buffer[meta.offset : meta.offset + meta.nbytes].view(dtype).view(meta.shape)


def unpack(buffer: torch.Tensor, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one bucket as (name, view) pairs sharing `buffer`'s memory."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError(
            f"bucket buffer must be a 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    descriptor.validate(buffer.numel())
    return [(meta.name, tensor_view(buffer, meta)) for meta in descriptor.tensors]


def fill_buckets(
    plans: list[BucketPlan],
    tensors: Iterator[tuple[str, torch.Tensor]],
    get_buffer,
) -> Iterator[BucketPlan]:
    """Copy the stream `tensors` into buckets as laid out by `plans`, yielding each full bucket.

    `get_buffer(plan)` returns the writable uint8 buffer for that bucket (a transport slot). The
    stream must yield exactly the planned names in the planned order; anything else is an error,
    raised before the bucket holding it is handed out.
    """
    for plan in plans:
        buffer = get_buffer(plan)
        for meta in plan.tensors:
            write_tensor(buffer, meta, _next_tensor(plan, meta, tensors))
        yield plan
    check_stream_end(tensors)


def _next_tensor(
    plan: BucketPlan, meta: TensorMeta, tensors: Iterator[tuple[str, torch.Tensor]]
) -> torch.Tensor:
    """The stream's next tensor, which must be the one `meta` plans."""
    try:
        name, tensor = next(tensors)
    except StopIteration:
        raise ValueError(
            f"tensor stream ended before {meta.name!r} (bucket {plan.index}); the model "
            f"has fewer tensors than its refit info"
        ) from None
    if name != meta.name:
        raise ValueError(
            f"tensor stream gave {name!r} where refit info expects {meta.name!r}; "
            f"the model changed since refit info was taken"
        )
    return tensor


def check_tensor(meta: TensorMeta, tensor: torch.Tensor) -> None:
    """Raise unless `tensor` has the shape and dtype `meta` was planned with."""
    if tuple(tensor.shape) != meta.shape:
        raise ValueError(
            f"tensor {meta.name!r}: shape {tuple(tensor.shape)} != planned {meta.shape}; "
            f"the model changed since refit info was taken; call refit_info() again"
        )
    dtype = dtype_to_str(tensor.dtype)
    if dtype != meta.dtype:
        raise ValueError(
            f"tensor {meta.name!r}: dtype {dtype} != planned {meta.dtype}; convert it or take "
            f"refit info again"
        )


def take_bucket(
    plan: BucketPlan, tensors: Iterator[tuple[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """The next tensors of the stream `tensors` that make up `plan`, checked against it, for
    transports that pass tensors in place instead of copying them into a bucket (same errors
    as `fill_buckets`). Names, shapes and dtypes are compared in bulk (no Python per tensor);
    only a mismatch walks the tensors one by one to name it."""
    expected = plan._expected
    if expected is None:
        expected = plan._expected = (
            [m.name for m in plan.tensors],
            [torch.Size(m.shape) for m in plan.tensors],
            [dtype_from_str(m.dtype) for m in plan.tensors],
        )
    items = list(itertools.islice(tensors, len(expected[0])))
    taken = [t for _, t in items]
    if (
        [n for n, _ in items] == expected[0]
        and list(map(_size, taken)) == expected[1]
        and list(map(_dtype, taken)) == expected[2]
    ):
        return taken
    stream = iter(items)
    for meta in plan.tensors:  # raises naming the first mismatch
        check_tensor(meta, _next_tensor(plan, meta, stream))
    return taken


_size = torch.Tensor.size
_dtype = operator.attrgetter("dtype")


def check_stream_end(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Raise if the stream `tensors` has anything left after the last bucket."""
    extra = next(tensors, None)
    if extra is not None:
        raise ValueError(
            f"tensor stream has {extra[0]!r} beyond its refit info; take refit info again"
        )
