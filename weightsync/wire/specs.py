"""The wire format: the plain data that crosses between trainer and engine environments.

Nothing here holds a torch object once it is on the wire. Tensors travel as raw bytes in a
transport buffer; what travels beside them is a `BucketDescriptor`: the transport's handle (where
the bytes are) plus one `TensorMeta` per tensor (name, dtype string, shape, offset). Both sides may
run different torch releases, so dtypes are spelled as strings and mapped on each side.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightsync.wire.errors import BucketRejected, error_from_wire, error_to_wire

_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "float64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
        "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
        "float8_e5m2": getattr(torch, "float8_e5m2", None),
    }.items()
    if dtype is not None
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
_SIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in _DTYPES.items()}

# Offsets inside a bucket are multiples of this, so every view is aligned for any dtype and for
# vectorised copies.
ALIGNMENT_BYTES = 64


def dtype_from_str(name: str) -> torch.dtype:
    """The torch dtype spelled `name` ("bfloat16", "float32", ...)."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_to_str(dtype: torch.dtype) -> str:
    """The wire spelling of a torch dtype."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel; supported: {sorted(_DTYPES)}") from None


def element_size(dtype: str) -> int:
    """Bytes per element of the dtype spelled `dtype` (a table lookup: it runs per tensor)."""
    size = _SIZES.get(dtype)
    return size if size is not None else dtype_from_str(dtype).itemsize


def align(nbytes: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorSpec:
    """One tensor of refit info: what the trainer will send, in the engine's (HF) naming."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int = field(init=False, repr=False, compare=False)  # computed once: read per sync
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dtype_from_str(self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} must be non-negative ints")
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "numel", math.prod(self.shape))
        object.__setattr__(self, "nbytes", self.numel * element_size(self.dtype))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]))

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, dtype=dtype_to_str(tensor.dtype), shape=tuple(tensor.shape))


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorMeta:
    """Where one tensor lies inside a bucket's bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int = field(init=False, repr=False, compare=False)  # computed once: read per sync
    # The plain form, made once: a bucket's descriptor is sent every sync (~3 us a tensor).
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * element_size(self.dtype))

    def to_dict(self) -> dict[str, Any]:
        """The plain form; the same dict every call (its readers do not change it)."""
        if self._wire is None:
            wire = {
                "name": self.name,
                "dtype": self.dtype,
                "shape": list(self.shape),
                "offset": self.offset,
            }
            object.__setattr__(self, "_wire", wire)
            return wire
        return self._wire

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorMeta:
        return cls(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]), offset=d["offset"])


@dataclass(kw_only=True, slots=True)
class BucketDescriptor:
    """One bucket on the wire: the transport handle plus the tensors packed in it.

    `handle` is the transport's own plain data (a shared-memory segment name, CUDA IPC handle
    bytes, a collective round); `nbytes` is how many bytes of the buffer are used.
    """

    index: int
    nbytes: int
    tensors: list[TensorMeta]
    handle: dict[str, Any] = field(default_factory=dict)

    def validate(self, buffer_nbytes: int) -> None:
        """Check that every tensor lies inside a buffer of `buffer_nbytes` bytes."""
        if self.nbytes > buffer_nbytes:
            raise BucketRejected(
                f"bucket {self.index}: descriptor says {self.nbytes} bytes but the buffer holds "
                f"{buffer_nbytes}"
            )
        for meta in self.tensors:
            dtype_from_str(meta.dtype)
            end = meta.offset + meta.nbytes
            if meta.offset < 0 or end > self.nbytes:
                raise BucketRejected(
                    f"bucket {self.index}: tensor {meta.name!r} spans bytes [{meta.offset}, {end}) "
                    f"outside the bucket's {self.nbytes} bytes; sender and receiver disagree "
                    f"on the layout"
                )
            if meta.offset % element_size(meta.dtype):
                raise BucketRejected(
                    f"bucket {self.index}: tensor {meta.name!r} offset {meta.offset} is not "
                    f"aligned for {meta.dtype}"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nbytes": self.nbytes,
            "handle": dict(self.handle),
            "tensors": [m.to_dict() for m in self.tensors],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BucketDescriptor:
        return cls(
            index=d["index"],
            nbytes=d["nbytes"],
            handle=dict(d.get("handle", {})),
            tensors=[TensorMeta.from_dict(m) for m in d["tensors"]],
        )


def specs_to_dicts(specs: list[TensorSpec]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in specs]


def specs_from_dicts(dicts: list[dict[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec.from_dict(d) for d in dicts]


_PLAIN_TYPES: tuple[type, ...] = (bool, int, float, str, bytes)  # bool first: it is an int


def as_plain(obj: Any) -> Any:
    """`obj` reduced to str/int/float/bool/None/bytes, lists and dicts: safe to cross envs."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): as_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_plain(v) for v in obj]
    # Subclasses (torch's TorchVersion is a str) would drag their defining module along.
    for plain in _PLAIN_TYPES:
        if isinstance(obj, plain):
            return plain(obj)
    if obj is None:
        return None
    raise TypeError(f"{type(obj).__name__} cannot cross an environment boundary: {obj!r}")


def ok_reply(result: Any) -> dict[str, Any]:
    """A call's outcome as plain data, for code inside an engine process that must not raise
    (an escaping exception kills SGLang's scheduler; vLLM drops its type)."""
    return {"ok": True, "result": result}


def error_reply(exc: BaseException) -> dict[str, Any]:
    """A failed call's outcome as plain data (weightsync/wire/errors.py says how it crosses)."""
    return {"ok": False, **error_to_wire(exc)}


def unwrap_all(replies: list[dict[str, Any]]) -> list[Any]:
    """Every reply's result, in worker order; a failed reply is raised again as `WIRE_ERRORS`
    says (the caller's bad input as itself, anything else as RuntimeError), with a note naming
    the worker when there are several. A `BucketRejected` says the engine's weights are as they
    were; where other workers of the engine did the call, theirs may not be: it is raised as a
    RuntimeError naming them (the engine counts the call as one that may have written)."""
    for i, reply in enumerate(replies):
        if not reply["ok"]:
            exc = error_from_wire(reply)
            done = [j for j, r in enumerate(replies) if r["ok"]]
            if isinstance(exc, BucketRejected) and done:
                raise RuntimeError(
                    f"engine worker {i} of {len(replies)} refused before writing ({exc}), but "
                    f"worker(s) {done} did the call: the engine's weights may be partly written"
                )
            if len(replies) > 1:
                exc.add_note(f"from engine worker {i} of {len(replies)}")
            raise exc
    return [reply["result"] for reply in replies]
