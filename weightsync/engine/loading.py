"""Loading buckets, inside an engine's model process: transport bytes in, the engine's loader out.

Each bucket is checked against what the refit check accepted before any byte is read (a refusal
is `BucketRejected`: nothing was written), mapped as views through its transport, and handed to
the engine's own loader, so fused QKV, transposed Conv1D and tied heads stay the engine's
business.

Plain copies in one call, for receivers whose load function hands each tensor to its parameter
under the same name (`plain_copies`: the reference `ModuleWeightReceiver`; never an engine, whose
`load_weights` may rename, stack or transpose before any parameter loader runs): a tensor that
lands in exactly one parameter of its own shape and dtype, which has no loader of its own and
whose default loader is `copy_loader`, is copied together with the bucket's other such tensors
below 4 MiB in one `torch._foreach_copy_` (a few fused kernels on a GPU), larger ones each in one
`copy_`, not one loader call each. Everything else goes through the load function. A bucket the
transport replays (CUDA IPC: the same views as last time) reuses the copy lists it was split into
the first time it was replayed. On a GPU those lists are also coalesced: consecutive plain copies
whose sources lie back to back in one allocation and whose parameters lie back to back in one
allocation become one byte copy (a trainer's and an engine's parameters allocated in the same
order: a few copies at the copy rate instead of one kernel slice per tensor), captured once into
a CUDA graph (weightsync/gpu/copies.py). A replayed load then costs a pointer comparison per parameter (a
parameter whose memory moved rebuilds the lists and the graph) and one graph launch.

Placed replays, for engines whose loaders rename, fuse or slice (`placed`): the first load of a
tensor goes through the engine's loader, which shows where it puts the tensor's elements
(`ModelReceiver.learn_placements`, or where a receiver knows it: weightsync/wire/placement.py,
verbatim copies into one parameter only); from the bucket's first replay on, a tensor with such
a placement of at most `PLACED_PATTERNS` runs is copied along it with the plain copies (the same
lists, coalescing and graph), not handed to the loader again. A tensor without one still goes
through the loader, every time.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch

from weightsync.engine.refit import copy_loader
from weightsync.gpu import copies
from weightsync.gpu.copies import capture, coalesce, issue
from weightsync.transports import ReceiverTransport, make_receiver
from weightsync.wire.errors import BucketRejected
from weightsync.wire.placement import pattern_view

if TYPE_CHECKING:
    from weightsync.engine.refit import LoadFn, RefitCheck
    from weightsync.wire.specs import BucketDescriptor

# A placement of more runs than this (a transposing loader: one run per row) is left to the
# loader: one strided copy per run would cost more than the loader's one call.
PLACED_PATTERNS = 8


class BucketLoader:
    """Receives one model replica's buckets through their transports (one receiving transport
    per kind, kept open across syncs) and loads them through the engine's loader."""

    def __init__(
        self,
        refit: RefitCheck,
        *,
        load_fn: LoadFn,
        name: str = "engine",
        plain_copies: bool = False,
        answers_reach_sender: bool = False,
    ) -> None:
        self.refit = refit
        # this process's load reports reach the sender whole (`ReceiverTransport`)
        self.answers_reach_sender = answers_reach_sender
        self.load_fn = load_fn
        self.name = name
        self._transports: dict[str, ReceiverTransport] = {}
        self.plain_copies = plain_copies  # see the module doc
        # tensor -> [parameter, patterns] where the loader copies it verbatim (module doc);
        # None: replayed buckets go through the loader
        self.placed: dict[str, list] | None = None
        self._params: dict[str, torch.nn.Parameter] | None = None
        self._where: dict[int, str] | None = None  # id(parameter) -> its name
        self._plain: dict[str, torch.nn.Parameter | None] = {}  # tensor -> parameter
        self._replayed: tuple[int, list] | None = None  # (bucket, views) `receive` replayed
        # bucket index -> (its replayed views, big copies [(dst, src)], small copies
        # [(dsts, srcs)], the rest, the parameters copied into, their data pointers then)
        self._copy_lists: dict[int, tuple] = {}
        self.loader_tensors = 0  # tensors handed to `load_fn` by `load`, all along

    def transport(self, kind: str) -> ReceiverTransport:
        """The receiving transport for handles of `kind`, made on first use."""
        transport = self._transports.get(kind)
        if transport is None:
            transport = self._transports[kind] = make_receiver(kind)
            transport.answers_reach_sender = self.answers_reach_sender
        return transport

    def check_descriptor(self, descriptor: BucketDescriptor) -> None:
        """Every tensor of the bucket was accepted by the refit check, with the same dtype and
        shape."""
        accepted = self.refit.accepted
        if not accepted:
            raise BucketRejected(f"{self.name}: load before check_refit; call check_refit first")
        for meta in descriptor.tensors:
            spec = accepted.get(meta.name)
            if spec is None:
                raise BucketRejected(
                    f"{self.name}: bucket {descriptor.index} carries "
                    f"{meta.name!r}, which refit info did not announce"
                )
            if spec.shape != meta.shape or spec.dtype != meta.dtype:
                raise BucketRejected(
                    f"{self.name}: tensor {meta.name!r}: bucket has {meta.dtype} {meta.shape}, "
                    f"refit info announced {spec.dtype} {spec.shape}"
                )

    def receive(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """Views of one bucket's tensors, after checking them against refit info."""
        self.check_descriptor(descriptor)
        views = self.transport(descriptor.handle["kind"]).receive_tensors(descriptor)
        self._replayed = None
        if descriptor.handle.get("same"):
            self._replayed = (descriptor.index, views)
        else:
            self._copy_lists.pop(descriptor.index, None)  # its views changed
        return views

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Into the live parameters: plain (and, replayed, placed) copies together, the rest
        through the engine's loaders (module doc)."""
        replayed = self._replayed if self._replayed and self._replayed[1] is named_tensors else None
        if not self.plain_copies and not (replayed and self.placed):
            self.loader_tensors += len(named_tensors)
            self.load_fn(iter(named_tensors))
            return
        lists = self._copy_lists.get(replayed[0]) if replayed else None
        if lists is not None and (
            lists[0] is not named_tensors
            or not all(map(operator.is_, map(dict.get, lists[6], lists[7]), lists[4]))
            or list(map(_data_ptr, lists[4])) != lists[5]
        ):
            lists = None  # new views, a parameter replaced, or a parameter's memory moved
        if lists is None:
            plain, rest, targets = self._split(named_tensors, placed=replayed is not None)
            if replayed and plain and plain[0][1].is_cuda:  # kept while replayed: coalesce
                big, small = coalesce(plain)
                if copies.GRAPHS:  # the copies captured once, then one launch per load
                    big, small = [(capture(big, small, plain[0][1].device), None)], []
            else:
                big = [(dst, src) for dst, src in plain if _nbytes(src) >= copies.ONE_COPY_BYTES]
                small_pairs = [
                    (dst, src) for dst, src in plain if _nbytes(src) < copies.ONE_COPY_BYTES
                ]
                small = [([d for d, _ in small_pairs], [s for _, s in small_pairs])]
            lists = (named_tensors, big, small, rest)
            if replayed:
                homes = self._homes(targets)
                self._copy_lists[replayed[0]] = (
                    *lists,
                    targets,
                    list(map(_data_ptr, targets)),
                    *homes,
                )
        _, big, small, rest = lists[:4]
        issue(big, small)
        if rest:
            self.loader_tensors += len(rest)
            self.load_fn(iter(rest))

    def _split(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, placed: bool
    ) -> tuple[list, list, list]:
        """(plain copies [(destination, source)] in bucket order, the rest [(name, tensor)],
        the parameters the copies write). `placed`: a replayed bucket, whose tensors with a
        placement are copied along it."""
        plain, rest, targets = [], [], []
        for name, tensor in named_tensors:
            param = self._plain_target(name, tensor) if self.plain_copies else None
            if param is not None:
                plain.append((param.data, tensor))
                targets.append(param)
                continue
            pairs = self._placed_copies(name, tensor) if placed else None
            if pairs is None:
                rest.append((name, tensor))
                continue
            plain.extend(pairs[1])
            targets.append(pairs[0])
        return plain, rest, targets

    def _placed_copies(
        self, name: str, tensor: torch.Tensor
    ) -> tuple[torch.nn.Parameter, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """(parameter, [(destination view, source view)]) that put `tensor` where the engine's
        loader put it (`placed`), or None: no placement, or one that no longer fits."""
        entry = self.placed.get(name) if self.placed else None
        if entry is None or not 0 < len(entry[1]) <= PLACED_PATTERNS:
            return None
        param = self._param(entry[0])
        if (
            param is None
            or param.dtype != tensor.dtype
            or param.device != tensor.device
            or not param.data.is_contiguous()
            or not tensor.is_contiguous()
        ):
            return None
        dst_flat, src_flat = param.data.reshape(-1), tensor.reshape(-1)
        pairs = []
        for pattern in entry[1]:
            start, source, length, count, dst_stride, src_stride = pattern
            if (
                start + (count - 1) * dst_stride + length > dst_flat.numel()
                or source + (count - 1) * src_stride + length > src_flat.numel()
            ):
                return None
            dst = pattern_view(dst_flat, pattern, dst=True)
            src = pattern_view(src_flat, pattern)
            if count == 1:
                dst, src = dst.reshape(-1), src.reshape(-1)
            pairs.append((dst, src))
        return param, pairs

    def _param(self, name: str) -> torch.nn.Parameter | None:
        """The parameter registered as `name` now (an engine may replace one, e.g. when it
        re-packs weights after loading)."""
        if self._params is None or name not in self._params:
            self._params = dict(self.refit.model.named_parameters())
        param = self._params.get(name)
        prefix, _, key = name.rpartition(".")
        if (
            param is not None
            and self.refit.model.get_submodule(prefix)._parameters.get(key) is not param
        ):
            self._params = dict(self.refit.model.named_parameters())
            param = self._params.get(name)
        return param

    def _homes(self, params: list[torch.nn.Parameter]) -> tuple[list[dict], list[str]]:
        """Where each of `params` is registered (its module's `_parameters`, its key): a kept
        copy list is used again only while each is still registered there."""
        if self._where is None or any(id(p) not in self._where for p in params):
            model = self.refit.model
            self._where = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        tables, keys = [], []
        for param in params:
            prefix, _, key = self._where.get(id(param), "").rpartition(".")
            tables.append(self.refit.model.get_submodule(prefix)._parameters if key else {})
            keys.append(key)
        return tables, keys

    def _plain_target(self, name: str, tensor: torch.Tensor) -> torch.nn.Parameter | None:
        """The parameter `tensor` is copied into whole by a plain loader, or None. Which
        parameter and loader is decided once per name, after the refit check (or the first
        load) mapped it; shape, dtype and device are checked on every call."""
        if name in self._plain:
            param = self._plain[name]
        else:
            targets = self.refit.param_of.get(name)
            if targets is None:  # not mapped yet (an engine that learns it while loading)
                return None
            param = self._param(targets[0]) if len(targets) == 1 else None
            if param is not None and (
                getattr(param, "weight_loader", None) is not None
                or self.refit.default_loader is not copy_loader
            ):
                param = None
            self._plain[name] = param
        if (
            param is None
            or param.shape != tensor.shape
            or param.dtype != tensor.dtype
            or param.device != tensor.device
        ):
            return None
        return param

    def release(self, descriptor: BucketDescriptor) -> dict[str, Any] | None:
        """The bucket is loaded: its transport may hand the bytes back to the sender (what
        the sender waits for, if anything: `ReceiverTransport.release`)."""
        return self.transport(descriptor.handle["kind"]).release(descriptor.handle)

    def settle(self) -> None:
        """Wait until every load so far is written (`ReceiverTransport.settle`)."""
        for transport in self._transports.values():
            transport.settle()

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()


_data_ptr = torch.Tensor.data_ptr


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
