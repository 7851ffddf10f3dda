"""A trainer rank's one-copy writes, worked out once and copied again every sync.

Cutting a rank's shards into pieces and finding each piece's place costs ~35 us of Python a
tensor (the state-dict walk, the DTensor placement checks, a view per piece and target): with
thousands of tensors (an MoE's experts) more than the copying itself. A `WritePlan` keeps, for
every piece the rank writes, its source (a view of the parameter's own storage, which the
optimizer updates in place) and its destination view in each engine's shared parameters. A
sync checks that every parameter is still the object and storage planned and issues the copies:
on the CPU through one `torch._foreach_copy_` (which also converts the dtype); on a GPU (the
engines' exported CUDA storages, weightsync/engine/one_copy/cuda_exports.py) coalesced where sources and
destinations both lie back to back and replayed as one CUDA graph, the small copies the fused
kernel can take as one launch of it (weightsync/gpu/kernel.py `Copies`). Tensors gathered per sync
(tensor-parallel ones: a collective, on every rank in the same order) are cut each sync as
without a plan. A verified sync on a GPU runs the same copies as one fused copy-and-read-back
kernel per device (weightsync/gpu/kernel.py); on the CPU in batches, each read back and compared
while in cache (weightsync/trainer/one_copy/targets.py `CheckedCopiesCPU`).
"""

from __future__ import annotations

import operator
import time
from itertools import repeat
from typing import Any

import torch

from weightsync.gpu import copies, kernel
from weightsync.gpu.copies import capture, coalesce, issue
from weightsync.trainer.one_copy.targets import CheckedCopiesCPU, OneCopyTarget
from weightsync.trainer.shard_writes import BeforeWrite
from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.trainer.sync_group import SyncGroup


def _slot(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> tuple[dict, str] | None:
    """The dict (a module's `_parameters` or `_buffers`) and key under which state-dict entry
    `name` lives, or None where the state dict renames it."""
    prefix, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    for table in (module._parameters, module._buffers):
        if table.get(attr) is tensor:
            return table, attr
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (what `to_local()` returns without autograd, read as the
    attribute: ~0.1 us instead of ~1.5 us a call, checked for every tensor every sync); any
    other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def same_targets(a: list[OneCopyTarget], b: list[OneCopyTarget]) -> bool:
    """Whether two lists hold the same target objects, in order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class WritePlan:
    """Where every piece of one rank goes in a fixed set of engine targets (see module doc).

    Build it under `torch.no_grad()`. `None` from `build` means the model's state dict cannot
    be planned (it renames entries): write piece by piece."""

    def __init__(self, pieces: ShardPieces, targets: list[OneCopyTarget]) -> None:
        self.pieces = pieces
        self.targets = targets
        # Each planned tensor's home (a module's _parameters or _buffers, and key), the tensor,
        # and its local tensor's data_ptr: checked in bulk every sync (`holds`).
        self.tables: list[dict] = []
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.names: list[str] = []  # each copy's trainer tensor
        self.each_sync: list[tuple[str, dict, str]] = []  # native tensors cut every sync
        self.copies: list[tuple[list, list]] = []  # the copies, batched (`_batched`)
        self._checked: list[tuple[Any, list[str]]] | None = None
        self.count = 0  # pieces copied through the plan
        self.nbytes = [0] * len(targets)  # bytes copied into each target

    @classmethod
    def build(cls, pieces: ShardPieces, targets: list[OneCopyTarget]) -> WritePlan | None:
        plan = cls(pieces, targets)
        source = pieces.source
        for name, tensor in source._native().items():
            slot = _slot(source.model, name, tensor)
            if slot is None:
                return None
            plan.tables.append(slot[0])
            plan.keys.append(slot[1])
            plan.tensors.append(tensor)
            local = _local(tensor)
            plan.ptrs.append(local.data_ptr())
            if pieces.gathers(name, tensor) or not plan._add(name, tensor, local):
                plan.each_sync.append((name, *slot))
        plan.copies = plan._batched()
        return plan

    def _batched(self) -> list[tuple[list, list]]:
        """The planned copies as `copies.issue` arguments: on the CPU one
        `_foreach_copy_`; on a GPU, per destination device, the copies between equal dtypes
        coalesced where both sides lie back to back; the small ones the fused kernel can take
        as one launch of it (weightsync/gpu/kernel.py `Copies`), the rest captured into one CUDA
        graph."""
        if not self.on_gpu:
            return [([], [(self.dsts, self.srcs)])]
        by_device: dict[torch.device, tuple[list, list]] = {}
        for dst, src in zip(self.dsts, self.srcs):
            plain, converted = by_device.setdefault(dst.device, ([], []))
            (plain if dst.dtype == src.dtype else converted).append((dst, src))
        out = []
        for device, (plain, converted) in by_device.items():
            big, small = coalesce(plain)
            fused: list = []
            if copies.FUSED and kernel.available():  # small copies: one kernel launch
                take, rest = [], []
                for dsts, srcs in small:  # one group per dtype pair: keep them apart
                    kept: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
                    for d, s in zip(dsts, srcs):
                        if kernel.fusable(d, s):
                            take.append((d, s))
                        else:
                            kept[0].append(d)
                            kept[1].append(s)
                    if kept[0]:
                        rest.append(kept)
                if take:
                    fused, small = [(kernel.Copies(take, device), None)], rest
            if converted:
                small.append(([d for d, _ in converted], [s for _, s in converted]))
            if copies.GRAPHS and (big or small):
                big, small = [(capture(big, small, device), None)], []
            out.append((big + fused, small))
        return out

    def _add(self, name: str, tensor: torch.Tensor, local: torch.Tensor) -> bool:
        """Plan every piece of native tensor `name`; False (nothing planned) where one cannot
        be copied from a view of the parameter's storage."""
        dsts, srcs, names, count, nbytes = [], [], [], 0, [0] * len(self.targets)
        base = local.untyped_storage().data_ptr()
        for piece in self.pieces.pieces(name, tensor):
            if piece.src is None:
                continue
            if piece.src.untyped_storage().data_ptr() != base:
                return False
            for i, target in enumerate(self.targets):
                pairs = target.copies(piece.name, piece.offset, piece.src, piece.dtype)
                if pairs is None:
                    return False
                for dst, src in pairs:
                    dsts.append(dst)
                    srcs.append(src)
                    names.append(piece.name)
                    nbytes[i] += dst.numel() * dst.element_size()
            count += 1
        self.dsts += dsts
        self.srcs += srcs
        self.names += names
        self.count += count
        self.nbytes = [a + b for a, b in zip(self.nbytes, nbytes)]
        return True

    @property
    def on_gpu(self) -> bool:
        """Whether the planned copies go into GPU memory (asynchronous, see `issue`)."""
        return bool(self.dsts) and self.dsts[0].device.type == "cuda"

    def holds(self, targets: list[OneCopyTarget]) -> bool:
        """Whether the plan still writes what a piece-by-piece write into `targets` would: the
        same targets, every parameter the same object over the same storage."""
        if not same_targets(targets, self.targets):
            return False
        self.pieces.source.reshard()
        # Loops in C (map): ~0.3 us a tensor, thousands of tensors every sync.
        tensors = self.tensors
        if not all(map(operator.is_, map(dict.get, self.tables, self.keys), tensors)):
            return False
        locals_ = map(getattr, tensors, repeat("_local_tensor"), tensors)
        return list(map(torch.Tensor.data_ptr, locals_)) == self.ptrs

    @property
    def checks(self) -> bool:
        """Whether `write(verify=True)` can verify through the plan: CPU targets (batches
        read back in cache, `targets.CheckedCopiesCPU`), GPU targets where Triton runs (one
        fused copy-and-read-back kernel)."""
        return not self.on_gpu or kernel.available()

    def _verified_copies(self) -> list[tuple[Any, list[str]]]:
        if self._checked is None:
            by_device: dict[torch.device, tuple[list, list]] = {}
            for dst, src, name in zip(self.dsts, self.srcs, self.names):
                pairs, names = by_device.setdefault(dst.device, ([], []))
                pairs.append((dst, src))
                names.append(name)
            self._checked = [
                (
                    CheckedCopiesCPU(pairs)
                    if device.type == "cpu"
                    else kernel.CheckedCopies(pairs, device),
                    names,
                )
                for device, (pairs, names) in by_device.items()
            ]
        return self._checked

    def launch(self, *, verify: bool = False) -> list:
        """Issue every planned copy (with `verify` the copy-and-read-back kernels, see
        `checks`) and count their bytes into the targets; not the tensors gathered per sync.
        On a GPU they run after this returns; `landed` takes what this returns."""
        launched = self._verified_copies() if verify else []
        for checked, _ in launched:
            checked.launch()
        if not verify:
            for big, small in self.copies:
                issue(big, small)
        for target, nbytes in zip(self.targets, self.nbytes):
            target.written += nbytes
        return launched

    @staticmethod
    def landed(launched: list) -> set[str]:
        """The tensors whose bytes read back differently in `launch`'s verified copies (waits
        for them; none when it did not verify)."""
        return {names[i] for checked, names in launched for i in checked.differing()}

    def write(self, *, verify: bool = False) -> tuple[int, set[str]]:
        """Copy every piece into every target; (how many pieces of this rank's were written,
        the tensors whose bytes read back differently: only with `verify`, see `checks`)."""
        mismatched = self.landed(self.launch(verify=verify))
        count = self.count
        for name, table, key in self.each_sync:
            for piece in self.pieces.pieces(name, table[key]):
                data = piece.data()
                if data is None:
                    continue
                raw = data.reshape(-1).view(torch.uint8)
                for target in self.targets:
                    if not target.write(piece.name, piece.offset, raw, check=verify):
                        mismatched.add(piece.name)
                count += 1
        return count, mismatched


def worker_shares(shared: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An engine's `share_params()["shared"]`: one worker's description, or a list of them (a
    tensor-parallel engine's, each worker's slices in its own segment)."""
    return shared if isinstance(shared, list) else [shared]


class _PieceByPiece:
    """A write plan's stand-in for a model whose state dict cannot be planned."""

    def __init__(self, writer: OneCopyWriter, targets: list[OneCopyTarget]) -> None:
        self.writer, self.targets = writer, targets

    def holds(self, targets: list[OneCopyTarget]) -> bool:
        return same_targets(targets, self.targets)

    checks = True  # verifies piece by piece itself

    def write(self, *, verify: bool = False) -> tuple[int, set[str]]:
        return self.writer._write_each(self.targets, None, verify=verify)


class OneCopyWriter:
    """Every rank writes its own shards into the shared parameters of the engines it is told
    of, reading each chunk back when verifying (weightsync/trainer/one_copy/targets.py)."""

    def __init__(self, source: DTensorV2Source, group: SyncGroup) -> None:
        self.source = source
        self.group = group
        # A test hook, set after construction (the reliability suite pauses rank 0 here).
        self.before_write: BeforeWrite | None = None
        self.targets: dict[str, list[OneCopyTarget]] = {}  # engine -> each worker's parameters
        self.rank_write_s: list[float] = []  # rank 0: each rank's seconds in the last write
        self.plan: Any = None  # WritePlan of the last planned write

    def write(self, msg: dict[str, Any], *, verify: bool) -> dict[str, Any] | None:
        """Every rank, with rank 0's `msg` {"one_copy": engines, "new": {engine: shared}}.

        Returns on rank 0 how many pieces and bytes (into all engines' workers) were written and
        which tensors' bytes read back differently; None elsewhere."""
        for name in msg.get("fallback", ()):  # its parameters moved: let go of them
            self.forget(name)
        for name, shared in msg["new"].items():
            self.forget(name)
            self.targets[name] = [OneCopyTarget(s) for s in worker_shares(shared)]
        targets = [t for n in msg["one_copy"] for t in self.targets[n]]
        written_before = sum(t.written for t in targets)
        start = time.perf_counter()
        hook = self.before_write if self.group.rank == 0 else None
        # Without autograd a DTensor's to_local() is its local tensor, not an autograd call:
        # ~5 us less per tensor, which counts with thousands of them (MoE experts).
        with torch.no_grad():
            # Verified writes go through the plan too: on GPUs one fused copy-and-read-back
            # kernel (weightsync/gpu/kernel.py), on the CPU batches read back in cache.
            plan = None
            if hook is None and targets and self._replays(targets, verify=verify):
                pieces, mismatched = self._write_then_check(targets, verify=verify)
            else:
                if hook is None and targets:
                    plan = self._planned(targets)
                if plan is None or (verify and not plan.checks):
                    pieces, mismatched = self._write_each(targets, hook, verify=verify)
                else:
                    pieces, mismatched = plan.write(verify=verify)
            for target in targets:  # GPU copies are asynchronous: landed before we answer
                target.flush()
        seconds = time.perf_counter() - start
        nbytes = sum(t.written for t in targets) - written_before
        gathered = self.group.gather((pieces, sorted(mismatched), seconds, nbytes))
        if gathered is None:
            return None
        self.rank_write_s = [g[2] for g in gathered]
        return {
            "pieces": sum(g[0] for g in gathered),
            "mismatched": sorted({m for g in gathered for m in g[1]}),
            "bytes": sum(g[3] for g in gathered),
        }

    def _replays(self, targets: list[OneCopyTarget], *, verify: bool) -> bool:
        """Whether the last plan copies into `targets` (the same objects), cuts nothing per
        sync (gathered tensors, a collective every rank must take once, and those it could not
        plan) and, with `verify`, verifies its copies itself (GPU targets): then its copies are
        issued before the plan is checked (`_write_then_check`)."""
        plan = self.plan
        return (
            isinstance(plan, WritePlan)
            and not plan.each_sync
            and (plan.checks or not verify)
            and same_targets(targets, plan.targets)
        )

    def _write_then_check(
        self, targets: list[OneCopyTarget], *, verify: bool
    ) -> tuple[int, set[str]]:
        """Issue the plan's copies (verified: its copy-and-read-back kernels), then check the
        plan: on a GPU while they run (with thousands of tensors the check takes a good part of
        the copying's time). The copies read only the sources planned, which the plan keeps
        alive, so a stale plan costs a wasted copy, never a read of freed memory: should the
        model have changed, wait for those copies, plan again and write (and verify) once
        more, all before the engines' `end`. (A storage freed
        in place, `untyped_storage().resize_(0)`, is not kept alive by its views; FSDP2 does
        that to unsharded parameters only, never to the sharded ones the plan reads.)"""
        written = [t.written for t in targets]
        plan = self.plan
        launched = plan.launch(verify=verify)
        if plan.holds(targets):
            return plan.count, plan.landed(launched)
        plan.landed(launched)  # a wasted copy: wait for it, forget what it read back
        for target, before in zip(targets, written):
            target.flush()
            target.written = before
        return self._planned(targets).write(verify=verify)

    def _planned(self, targets: list[OneCopyTarget]) -> Any:
        """This rank's write plan into `targets`, made again when the model's parameters or
        the targets changed; piece by piece where the model cannot be planned."""
        if self.plan is None or not self.plan.holds(targets):
            pieces = ShardPieces(self.source, rank=self.group.rank)
            self.plan = WritePlan.build(pieces, targets) or _PieceByPiece(self, targets)
        return self.plan

    def _write_each(
        self, targets: list[OneCopyTarget], hook: BeforeWrite | None, *, verify: bool
    ) -> tuple[int, set[str]]:
        """Cut and write every piece (reading each back with `verify`); (pieces, mismatched)."""
        pieces, mismatched = 0, set()
        for index, (name, data, offset) in enumerate(
            ShardPieces(self.source, rank=self.group.rank) if targets else ()
        ):
            if hook is not None:
                hook("piece", index)
            if data is None:
                continue
            raw = data.reshape(-1).view(torch.uint8)
            for target in targets:
                if not target.write(name, offset, raw, check=verify):
                    mismatched.add(name)
            pieces += 1
        return pieces, mismatched

    def forget(self, name: str) -> None:
        self.plan = None  # its views point into the targets' segments
        for target in self.targets.pop(name, []):
            target.close()

    def close(self) -> None:
        for name in list(self.targets):
            self.forget(name)
