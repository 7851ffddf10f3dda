"""The DTensor v2 source: full, HF-named tensors out of a model whose parameters are DTensors.

"DTensor v2" is the layout nemo-automodel builds: FSDP2 (`fully_shard`) and/or tensor parallel
DTensor parameters, with an optional `state_dict_adapter` whose `to_hf()` maps the training
state dict to Hugging Face names. The source gathers one tensor at a time (`full_tensor()`), so no
rank ever holds more than one full tensor beyond the model itself. Gathering is a collective:
every rank of the trainer group iterates `tensors()` in the same order.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Collection, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple, TypeGuard

import torch

from weightsync.wire.specs import TensorSpec, dtype_from_str, dtype_to_str

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """alias name -> primary name, for parameters registered under more than one name.

    GPT-2 and OPT tie `lm_head.weight` to the token embedding: the engines tie them the same way
    and load only the embedding, so the alias is not sent (a differing lm_head would be ignored
    by the engine and leave trainer and engine silently apart).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        primary = first.setdefault(id(param), name)
        if primary != name:
            aliases[name] = primary
    return aliases


def _shapes(tensors: list[torch.Tensor]) -> list[torch.Size]:
    """Every tensor's global shape. A DTensor's is read from its spec (~0.1 us), not through
    `.shape` (~3 us: its sizes go through Python dispatch; 0.2 s a sync at 70k tensors). The
    spec is what a gather makes and what FSDP2 keeps; `param.data = x` on a DTensor leaves its
    spec and local tensor as they were (torch's own behaviour), and so does this."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return [t.shape for t in tensors]
    return [t._spec.shape if type(t) is DTensor else t.shape for t in tensors]


_dtype = operator.attrgetter("dtype")
_meta = operator.attrgetter("_spec.tensor_meta")  # a DTensor's global shape, stride and dtype
_shape = operator.attrgetter("shape")


class _SameLayout:
    """What `DTensorV2Source.layout` returned last, and a check in a few passes at C speed
    (~0.1 us a tensor) that it still holds for the same state dict (the source's own, which
    `_Homes.hold` found still registered): every DTensor's spec has the same `tensor_meta`
    object as then (an immutable tuple: its global shape, stride and dtype; torch gives a
    DTensor a new one when they change, and `param.data = x` leaves the spec as it was), every
    other tensor the same shape and dtype."""

    def __init__(self, native: dict[str, torch.Tensor], layout: Layout) -> None:
        try:
            from torch.distributed.tensor import DTensor

            kind: type | None = DTensor
        except ImportError:  # a torch built without distributed
            kind = None
        tensors = list(native.values())
        self.native = native
        self.layout = layout
        self.dtensors = [t for t in tensors if type(t) is kind]
        self.plain = [t for t in tensors if type(t) is not kind]
        self.tensors = tensors
        self.metas = list(map(_meta, self.dtensors))
        self.shapes = list(map(_shape, self.plain))
        self.dtypes = list(map(_dtype, self.plain))

    def holds(self, native: dict[str, torch.Tensor]) -> bool:
        return (
            native is self.native
            and len(native) == len(self.tensors)
            and all(map(operator.is_, map(_meta, self.dtensors), self.metas))
            and list(map(_shape, self.plain)) == self.shapes
            and list(map(_dtype, self.plain)) == self.dtypes
        )


class _Homes:
    """Where each tensor of a state dict is registered (its module's `_parameters` or
    `_buffers`, and its key), and where each module is: `hold()` says, in a few passes at C
    speed, whether every place still holds the same object and no module gained or lost a
    parameter, buffer or child, so a model whose tensors were not replaced is not walked again
    (a state dict of 200k tensors takes ~1 s to build)."""

    def __init__(
        self, state: dict[str, torch.Tensor], places: list[tuple[dict, str, object]], dicts: list
    ) -> None:
        self.state = state
        self.tables = [table for table, _, _ in places]
        self.keys = [key for _, key, _ in places]
        self.objects = [obj for _, _, obj in places]
        self.dicts = dicts
        self.sizes = list(map(len, dicts))

    @classmethod
    def of(cls, model: nn.Module, state: dict[str, torch.Tensor]) -> _Homes | None:
        """None when some entry is not a registered parameter or buffer (a state-dict hook's,
        an extra state): the state dict is then built every time."""
        modules = dict(model.named_modules(remove_duplicate=False))
        places: list[tuple[dict, str, object]] = []
        for name, module in modules.items():
            if name:
                prefix, _, key = name.rpartition(".")
                places.append((modules[prefix]._modules, key, module))
        for name, tensor in state.items():
            prefix, _, key = name.rpartition(".")
            module = modules.get(prefix)
            if module is None:
                return None
            table = module._parameters if key in module._parameters else module._buffers
            if table.get(key) is not tensor:
                return None
            places.append((table, key, tensor))
        dicts = [d for m in modules.values() for d in (m._modules, m._parameters, m._buffers)]
        return cls(state, places, dicts)

    def hold(self) -> bool:
        return list(map(len, self.dicts)) == self.sizes and all(
            map(operator.is_, map(dict.get, self.tables, self.keys), self.objects)
        )


def _global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor's shape is already the global one


_MESH_SIZES: dict[int, tuple[object, int]] = {}  # id -> (the mesh, kept alive; its size)


def _mesh_size(mesh: DeviceMesh) -> int:
    """`mesh.size()`, asked once per mesh (~13 us a call through the mesh's layout)."""
    known = _MESH_SIZES.get(id(mesh))
    if known is None or known[0] is not mesh:
        known = _MESH_SIZES[id(mesh)] = (mesh, mesh.size())
    return known[1]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of `tensor`, detached. A DTensor on a mesh of one rank holds it whole: its
    local tensor, without `full_tensor()`'s redistribute (~80 us a tensor on a CPU: 17 s a
    sync at 200k tensors); otherwise gathered (collective: every rank of its mesh calls)."""
    if getattr(tensor, "full_tensor", None) is None:
        return tensor.detach()
    dtensor: DTensor = tensor  # type: ignore[assignment]
    if _mesh_size(dtensor.device_mesh) == 1:
        return dtensor._local_tensor.detach()
    detached: DTensor = dtensor.detach()  # type: ignore[assignment]
    return detached.full_tensor()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class CheckpointFormat:
    """The tensors that transformers stores differently in a model and in its checkpoints.

    transformers 5 builds some modules from several checkpoint tensors and splits them again
    in `save_pretrained` (`revert_weight_conversion`): a MoE layer's experts are two grouped
    parameters, `mlp.experts.gate_up_proj` (experts, 2 * ffn, hidden) and
    `mlp.experts.down_proj` (experts, hidden, ffn), which a checkpoint, and so an engine's
    loader, holds per expert: `mlp.experts.{e}.gate_proj.weight`, `.up_proj.weight`,
    `.down_proj.weight`. Engines receive what `save_pretrained` would write.

    `layouts`: native name -> {checkpoint name: "meta" tensor of its shape}, for the native
    tensors that convert (the others go as they are). `runs(name)`: where each checkpoint
    tensor lies in the native one, as the first element of one contiguous run (row-major), or
    None where it is not one run; the expert split is one run per checkpoint tensor, so a rank
    holding a dim-0 shard of the grouped tensor writes the experts it holds itself.
    """

    def __init__(self, model: nn.Module, native: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.layouts: dict[str, dict[str, torch.Tensor]] = {}
        self._runs: dict[tuple[str, tuple[int, ...]], list[int | None]] = {}
        self._revert = _transformers_revert(model)
        if self._revert is None:
            return
        meta = {
            name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in native.items()
        }
        whole = self._revert(model, dict(meta))
        changed = [
            name
            for name, t in meta.items()
            if name not in whole or tuple(whole[name].shape) != tuple(t.shape)
        ]
        made: set[str] = set()
        for name in changed:
            layout = self._revert(model, {name: meta[name]})
            if not set(layout) <= set(whole) or set(layout) & made:
                raise ValueError(
                    f"tensor {name!r}: transformers converts it to checkpoint tensors "
                    f"{sorted(layout)[:4]} only together with other tensors; give the model a "
                    f"state_dict_adapter whose to_hf() maps each tensor on its own"
                )
            made |= set(layout)
            self.layouts[name] = layout

    def to_checkpoint(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of the full native tensor `name`."""
        return self._revert(self.model, {name: tensor})

    def runs(self, name: str, shape: tuple[int, ...]) -> list[int | None]:
        """Each checkpoint tensor of `name` (in `layouts[name]` order): the index of its first
        element in the flattened native tensor when it is one contiguous run of it, else None.
        Learned once per layout (layers share one) by converting a tensor whose every element
        holds its own index."""
        key = (re.sub(r"\d+", "#", name), shape)
        runs = self._runs.get(key)
        if runs is None:
            numel = math.prod(shape)
            index_dtype = torch.int32 if numel < 2**31 else torch.int64
            probe = torch.arange(numel, dtype=index_dtype).view(shape)
            runs = []
            for out in self.to_checkpoint(name, probe).values():
                flat = out.reshape(-1)
                start = int(flat[0]) if flat.numel() else 0
                expected = torch.arange(start, start + flat.numel(), dtype=index_dtype)
                runs.append(start if torch.equal(flat, expected) else None)
            self._runs[key] = runs
        return runs


def _transformers_revert(model: nn.Module):
    """transformers' `revert_weight_conversion(model, state_dict)` when `model` is a
    transformers model with tensors to convert, else None."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x keeps checkpoint layouts in its modules
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    if getattr(model, "_weight_conversions", None) is None and not get_model_conversion_mapping(
        model, add_legacy=False
    ):
        return None
    return revert_weight_conversion


Layout = list[tuple[str, tuple[tuple[int, ...], str]]]
"""(name, (shape, dtype name)) of a model's tensors, in order: `DTensorV2Source.layout`."""


class DTensorV2Source:
    """Names, specs and gathered tensors of a (possibly sharded) model, in HF naming.

    `dtype`: convert floating-point tensors to this dtype ("bfloat16", ...) on the way out;
    None sends each tensor in its training dtype.
    """

    def __init__(self, model: nn.Module, *, dtype: str | None = None) -> None:
        self.model = model
        self.dtype = dtype_from_str(dtype) if dtype is not None else None
        self.aliases = tied_aliases(model)
        adapter = getattr(model, "state_dict_adapter", None)
        self.adapter = adapter if hasattr(adapter, "to_hf") else None
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._homes: _Homes | None = None
        self._held = 0  # inside `held()`
        self._held_state: dict[str, torch.Tensor] | None = None
        self._layout: tuple[list, list, Layout] | None = None
        self._same: _SameLayout | None = None  # the last layout, and its quick check
        self._pieces: dict[int, tuple] = {}  # ShardPieces' entries by rank
        # Without an adapter, the tensors transformers converts between its modules and its
        # checkpoints (grouped experts) are sent as the checkpoint holds them.
        self.checkpoint_format = (
            CheckpointFormat(model, self._native()) if self.adapter is None else None
        )

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """One sync's span, inside which the model is not changed (the trainer is inside the
        sync): its tensors are looked up once, not checked again at every use (`_Homes.hold`:
        ~1 us a tensor each time)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._held_state = None

    def _native(self) -> dict[str, torch.Tensor]:
        """The model's own state dict (training names), tied aliases left out.

        A forward that no backward followed (a no-grad pass for log-probs, an eval) leaves some
        FSDP2 units unsharded: the root always, and with nemo-automodel the last layer and the
        output head. Their parameters are then plain tensors in the compute dtype, so each unit
        is resharded first (local, no communication; never call this between a forward and
        its backward)."""
        self.reshard()
        if self._held_state is not None:
            return self._held_state  # looked up already in this sync (`held`)
        if self._homes is not None and self._homes.hold():
            if self._held:
                self._held_state = self._homes.state
            return self._homes.state  # the same tensors as last time: no state_dict walk
        # The parameters themselves (no DTensor detach per tensor, ~8 us each); readers only
        # read, without autograd (`detach` or `torch.no_grad` where they compute).
        state = self.model.state_dict(keep_vars=True)
        for alias in self.aliases:
            state.pop(alias, None)
        self._homes = _Homes.of(self.model, state)
        if self._held and self._homes is not None:
            self._held_state = state
        return state

    def reshard(self) -> None:
        """Put every FSDP2 unit back in its sharded state (local, no communication)."""
        for module in self._fsdp_modules:
            module.reshard()

    def converts(self, name: str) -> bool:
        """Whether native tensor `name` reaches the engines renamed or split."""
        if self.adapter is not None:
            return True
        return self.checkpoint_format is not None and name in self.checkpoint_format.layouts

    def _to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of one native tensor, which must be full (or on "meta"): given a
        grouped-expert DTensor sharded on the expert dim, nemo-automodel's MoE adapters return
        only this rank's experts (rank 0 of 2 would send experts 0-3 of 8)."""
        if self.adapter is not None:
            return self.adapter.to_hf({name: tensor})
        if self.checkpoint_format is not None and name in self.checkpoint_format.layouts:
            return self.checkpoint_format.to_checkpoint(name, tensor)
        return {name: tensor}

    def _hf_layout(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """What `_to_hf` makes of `tensor`, as "meta" tensors of the global shape."""
        if self.adapter is not None:
            return self._to_hf(name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        if self.checkpoint_format is not None and name in self.checkpoint_format.layouts:
            return self.checkpoint_format.layouts[name]
        return {name: tensor}

    def _out_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        if self.dtype is not None and tensor.dtype.is_floating_point:
            return self.dtype
        return tensor.dtype

    def specs(self) -> list[TensorSpec]:
        """What `tensors()` will yield, without gathering anything."""
        return [
            TensorSpec(name=hf_name, dtype=dtype_to_str(self._out_dtype(t)), shape=_global_shape(t))
            for name, native in self._native().items()
            for hf_name, t in self._hf_layout(name, native).items()
        ]

    def layout(self) -> Layout:
        """(training name, (global shape, dtype)) of every tensor, in order: cheap enough to
        compare before each sync (no TensorSpec made, nothing gathered; the same list as last
        time while the same tensors have the same shapes and dtypes: ~0.2 us a tensor)."""
        native = self._native()
        same = self._same
        if same is not None and same.holds(native):
            return same.layout
        tensors = list(native.values())
        shapes = _shapes(tensors)
        dtypes = list(map(_dtype, tensors))
        if self._layout is not None and self._layout[0] == shapes and self._layout[1] == dtypes:
            if len(self._layout[2]) == len(native):
                self._same = self._quick_check(native, self._layout[2])
                return self._layout[2]
        layout = [
            (name, (tuple(shape), str(dtype).removeprefix("torch.")))
            for name, shape, dtype in zip(native, shapes, dtypes)
        ]
        self._layout = (shapes, dtypes, layout)
        self._same = self._quick_check(native, layout)
        return layout

    def _quick_check(self, native: dict[str, torch.Tensor], layout: Layout) -> _SameLayout | None:
        """Only for the source's own state dict (`_Homes`): one built afresh every sync (a
        model `_Homes` cannot follow) is never the same object again."""
        return _SameLayout(native, layout) if self._homes is not None else None

    def nonfinite(self) -> list[str]:
        """The tensors whose part this rank holds has a NaN or an infinity, or a value its
        sending dtype cannot hold (float32 above 65504 sent as float16), by training name. Local:
        no communication, each rank reads its own shards once."""
        bad = []
        with torch.no_grad():
            for name, native in self._native().items():
                local = _local(native.detach())
                if not local.dtype.is_floating_point:
                    continue
                out_dtype = self._out_dtype(local)
                if out_dtype != local.dtype:
                    local = local.to(out_dtype)
                if not bool(torch.isfinite(local).all()):
                    bad.append(name)
        return bad

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, gathered one native tensor at a time. Collective: all
        ranks call."""
        for name, native in self._native().items():
            for hf_name, full in self._to_hf(name, _full(native)).items():
                out_dtype = self._out_dtype(full)
                if full.dtype != out_dtype:
                    full = full.to(out_dtype)
                yield hf_name, full.contiguous()


def _dim0_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor sharded along dim 0 over a 1-D mesh (FSDP2's layout)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1:
        return False
    placement = tensor.placements[0]
    return isinstance(placement, Shard) and placement.dim == 0


def _replicated(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import Replicate

    placements = getattr(tensor, "placements", None)
    return placements is not None and all(isinstance(p, Replicate) for p in placements)


class Piece(NamedTuple):
    """One rank's part of one engine tensor, before conversion to the dtype the engines get."""

    name: str
    src: torch.Tensor | None  # None: another rank writes this one (or it is empty here)
    offset: int  # byte offset of `src`'s bytes inside the full engine tensor
    dtype: torch.dtype  # the dtype the engines receive
    static: bool  # `src` is a view of the parameter's own storage (not gathered per sync)

    def data(self) -> torch.Tensor | None:
        return None if self.src is None else self.src.to(self.dtype).contiguous()


_GATHERED = object()  # an entry of `ShardPieces._entries` whose pieces are made each sync


def _local_pointers(tensors: Collection[torch.Tensor]) -> list[int]:
    """Each tensor's local storage pointer (a DTensor's local tensor's), at C speed."""
    return list(map(torch.Tensor.data_ptr, map(getattr, tensors, repeat("_local_tensor"), tensors)))


class ShardPieces:
    """Each rank's own part of every tensor, with its byte offset inside the full tensor.

    FSDP2 shards along dim 0, so a rank's shard is one contiguous byte range of the full
    (row-major) tensor: ranks can write their shards straight into a shared bucket, with no
    all-gather. Tensors sharded otherwise (tensor parallel) are gathered and written by rank 0.
    Yields (name, data or None, byte offset); every rank iterates in the same order.
    """

    def __init__(self, source: DTensorV2Source, *, rank: int) -> None:
        self.source = source
        self.rank = rank

    def _offset(self, name: str, tensor: DTensor, out_dtype: torch.dtype) -> int:
        """Byte offset of this rank's shard in the full tensor; the DTensor placement math
        costs ~40 us a tensor, so it is done once per layout and kept on the source."""
        cache = self.source.__dict__.setdefault("_shard_offsets", {})
        key = (name, tuple(tensor.shape), tuple(tensor.placements), out_dtype)
        offset = cache.get(key)
        if offset is None:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, start = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            offset = cache[key] = start[0] * math.prod(tensor.shape[1:]) * out_dtype.itemsize
        return offset

    def listed(self) -> list[tuple[str, torch.Tensor | None, int]] | None:
        """What `__iter__` yields, as one list kept with the walk, when every piece is sent as
        the rank holds it (no dtype conversion, no tensor gathered each sync); else None."""
        native = self.source._native()
        entries = self._entries(native)
        cache = self.source._pieces[self.rank]
        if len(cache) == 4:
            return cache[3]
        listed: list[tuple[str, torch.Tensor | None, int]] | None = None
        if all(e[0] is not _GATHERED and (e[4] or e[1] is None) for e in entries):
            listed = [(e[0], e[1], e[2]) for e in entries]
        self.source._pieces[self.rank] = (*cache, listed)
        return listed

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None, int]]:
        for entry in self._entries(self.source._native()):
            if entry[0] is _GATHERED:
                _, name, tensor = entry
                with torch.no_grad():  # `_native` gives the parameters themselves
                    pieces = [(p.name, p.data(), p.offset) for p in self.pieces(name, tensor)]
                yield from pieces
                continue
            name, src, offset, dtype, as_is = entry
            if as_is or src is None:
                yield name, src, offset
            else:
                with torch.no_grad():
                    data = src.to(dtype).contiguous()
                yield name, data, offset

    def _entries(self, native: dict[str, torch.Tensor]) -> list[tuple]:
        """Every tensor's pieces as `__iter__` walks them: (name, src, offset, dtype, whether
        src is sent as it is) for a rank's own part, (_GATHERED, name, tensor) for a tensor
        gathered each sync. Kept on the source while the state dict is the same object
        (`_Homes`: the same tensors) and every tensor's local storage the same, so a sync walks
        a list instead of each DTensor's placements (~20 us a tensor on a CPU)."""
        pointers = _local_pointers(native.values())
        cache = self.source._pieces.get(self.rank)
        if cache is not None and cache[0] is native and cache[1] == pointers:
            return cache[2]
        entries: list[tuple] = []
        with torch.no_grad():
            for name, tensor in native.items():
                if self.gathers(name, tensor):
                    entries.append((_GATHERED, name, tensor))
                    continue
                for p in self.pieces(name, tensor):
                    as_is = p.src is None or (p.src.dtype == p.dtype and p.src.is_contiguous())
                    entries.append((p.name, p.src, p.offset, p.dtype, as_is))
        self.source._pieces[self.rank] = (native, pointers, entries)
        return entries

    def extents(self) -> Iterator[tuple[str, int, int]]:
        """(name, nbytes, byte offset) of each piece `__iter__` yields, in the same order and
        without gathering anything: how many bytes of each tensor this rank writes, and where.
        Not a collective."""
        source = self.source
        for name, tensor in source._native().items():
            if self.gathers(name, tensor):
                for hf_name, meta in source._hf_layout(name, tensor).items():
                    nbytes = meta.numel() * source._out_dtype(meta).itemsize
                    yield hf_name, nbytes if self.rank == 0 else 0, 0
                continue
            for piece in self.pieces(name, tensor):
                src = piece.src
                yield (
                    piece.name,
                    0 if src is None else src.numel() * piece.dtype.itemsize,
                    piece.offset,
                )

    def gathers(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `pieces(name, tensor)` gathers the tensor (a collective; its pieces are then
        made afresh every sync). Depends only on the layout, so it is the same on every rank."""
        layout = self._split_layout(name, tensor)
        if layout is not None:
            return self._held_runs(name, tensor) is None
        return not (
            _dim0_sharded(tensor) or _replicated(tensor) or not hasattr(tensor, "placements")
        )

    def _split_layout(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The engine tensors of a native tensor that reaches the engines renamed or split."""
        if self.source.converts(name):
            layout = self.source._hf_layout(name, tensor)
            if list(layout) != [name] or layout[name].shape != tensor.shape:
                return layout
        return None

    def _held_runs(self, name: str, tensor: torch.Tensor) -> list[int] | None:
        """Where each engine tensor of split tensor `name` starts in it (`CheckpointFormat.runs`)
        when each is a contiguous run the ranks write from their dim-0 shards (grouped experts);
        None otherwise."""
        checkpoint_format = self.source.checkpoint_format
        if self.source.adapter is not None or checkpoint_format is None:
            return None
        if not _dim0_sharded(tensor):
            return None
        runs = checkpoint_format.runs(name, tuple(tensor.shape))
        return [r for r in runs if r is not None] if None not in runs else None

    def pieces(self, name: str, tensor: torch.Tensor) -> Iterator[Piece]:
        """The pieces of native tensor `name`, unconverted. A collective where `gathers`:
        every rank calls, in the same order."""
        layout = self._split_layout(name, tensor)
        if layout is not None:
            yield from self._converted(name, tensor, layout)
            return
        out_dtype = self.source._out_dtype(tensor)
        if _dim0_sharded(tensor):
            local = tensor.to_local()
            yield Piece(
                name,
                local if local.numel() else None,
                self._offset(name, tensor, out_dtype),
                out_dtype,
                True,
            )
        elif _replicated(tensor) or not hasattr(tensor, "placements"):
            local = _local(tensor)
            yield Piece(name, local if self.rank == 0 else None, 0, out_dtype, True)
        else:
            full = _full(tensor)
            yield Piece(name, full if self.rank == 0 else None, 0, out_dtype, False)

    def _converted(
        self, name: str, tensor: torch.Tensor, layout: dict[str, torch.Tensor]
    ) -> Iterator[Piece]:
        """The pieces of a native tensor that reaches the engines renamed or split. Checkpoint
        tensors that are each one contiguous run of a dim-0 sharded tensor (grouped experts):
        each rank writes the part of each run it holds. Otherwise (an adapter's conversion):
        gathered, converted and written by rank 0."""
        source = self.source
        runs = self._held_runs(name, tensor)
        if runs is None or not _dim0_sharded(tensor):  # (the second: for the type checker)
            for hf_name, full in source._to_hf(name, _full(tensor)).items():
                yield Piece(
                    hf_name, full if self.rank == 0 else None, 0, source._out_dtype(full), False
                )
            return
        if len(runs) != len(layout):
            raise RuntimeError(
                f"tensor {name!r}: transformers converts it into {len(runs)} checkpoint tensors "
                f"for the run probe but into {len(layout)} for its layout "
                f"({sorted(layout)[:4]}); give the model a state_dict_adapter whose to_hf() "
                f"maps each tensor on its own"
            )
        out_dtype = source._out_dtype(tensor)
        local = tensor.to_local().reshape(-1)
        low = self._offset(name, tensor, out_dtype) // out_dtype.itemsize
        high = low + local.numel()
        for (hf_name, meta), start in zip(layout.items(), runs):
            first, last = max(start, low), min(start + meta.numel(), high)
            if first >= last:
                yield Piece(hf_name, None, 0, out_dtype, True)
                continue
            yield Piece(
                hf_name,
                local[first - low : last - low],
                (first - start) * out_dtype.itemsize,
                out_dtype,
                True,
            )
