"""One model replica receiving weights (one engine worker process), whatever the engine.

`ModelReceiver` is the one implementation of the receive operations that every engine's backend
(vLLM's worker extension, SGLang's custom loader) and the reference receiver call; it is put
together from one part per job, each in its own module:
  weightsync/engine/refit.py              the refit check, a dry run of the engine's own loader
  weightsync/engine/loading.py            buckets from their transports into the engine's loader
  weightsync/engine/rollback.py           the previous weights, kept during an update to put back
  weightsync/engine/one_copy/sharing.py   the one-copy path: parameters shared with the trainer
  weightsync/wire/fingerprint.py          the engine parameters' fingerprints, for verification
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from weightsync.engine.loading import BucketLoader
from weightsync.engine.one_copy.sharing import ParameterSharing
from weightsync.engine.refit import RefitCheck
from weightsync.engine.rollback import PreviousWeights
from weightsync.wire.fingerprint import ModelPrints
from weightsync.wire.protocol import (
    LoadReport,
    RefitAnswer,
    ShareAnswer,
)
from weightsync.wire.specs import BucketDescriptor

if TYPE_CHECKING:
    import torch
    from torch import nn

    from weightsync.engine.refit import LoadFn, WeightLoader
    from weightsync.wire.specs import TensorSpec


class ModelReceiver:
    """Receiving weights into one model replica (one engine worker process): the parts the
    module doc lists, put together. The engine's backend calls it in `WeightReceiver`'s order:
    `check_refit` once; `open_update` as each update opens; `load_bucket` per bucket; per
    one-copy update `begin_one_copy`, then `end_one_copy`; `fingerprints` to verify.

    `load_fn` is the engine's own `model.load_weights`; `default_loader` is the engine's loader
    for parameters that carry no `weight_loader` of their own.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        load_fn: LoadFn,
        default_loader: WeightLoader,
        name: str = "engine",
        answers_reach_sender: bool = False,
        placed_replays: bool = False,
    ) -> None:
        """`answers_reach_sender`: this process's load reports go back to the sender as they
        are (one receiving process per engine): transports may answer with what the sender
        waits for instead of waiting themselves (weightsync/transports/cuda_ipc.py).
        `placed_replays`: a replayed bucket's tensors whose placements were learned are copied
        along them, without the engine's loader (`BucketLoader.placed`)."""
        self.model = model
        self.name = name
        self.load_fn = load_fn
        self.refit = RefitCheck(model, load_fn=load_fn, default_loader=default_loader, name=name)
        self.buckets = BucketLoader(
            self.refit, load_fn=load_fn, name=name, answers_reach_sender=answers_reach_sender
        )
        self.previous = PreviousWeights(model, self.refit, name=name)
        self.sharing = ParameterSharing(model, self.refit, load_fn=load_fn, name=name)
        # Trainer tensor -> [parameter, patterns] (`learn_placements`): for verification, and
        # at TP > 1 for the one-copy path's slices
        self.placements: dict[str, list] = {}
        if placed_replays:
            self.buckets.placed = self.placements
        self._unplaced: set[str] = set()
        # parameter -> the byte (8-aligned) after the whole tensors learned in it so far: where
        # the next bucket's tensors of it are guessed to start (`learn_placements`)
        self._ends: dict[str, int] = {}
        self._pools: dict[torch.device, torch.Tensor] = {}  # its random bytes, on the CPU
        self._writing = False  # a one-copy update is open: trainer ranks write the parameters
        self._prints = ModelPrints(model)
        # bucket index -> (its views, the map they were checked against, the parameters written)
        self._mapped: dict[int, tuple[list, dict, frozenset[str]]] = {}
        self._loaded: set[int] = set()  # buckets loaded in this update

    @property
    def param_of(self) -> dict[str, list[str]]:
        """Trainer tensor name -> the engine parameters it lands in."""
        return self.refit.param_of

    def check_refit(self, specs: list[TensorSpec]) -> RefitAnswer:
        return self.refit.check(specs)

    def receive(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        return self.buckets.receive(descriptor)

    def load(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, keep_previous: bool = False
    ) -> None:
        """Load through the engine's loaders. With `keep_previous`, first copy every parameter
        these tensors land in (once per update), so that `restore_previous()` can undo it."""
        if keep_previous:
            self.previous.keep([name for name, _ in named_tensors])
        self.buckets.load(named_tensors)

    def load_bucket(
        self,
        descriptor: BucketDescriptor,
        *,
        keep_previous: bool = False,
        learn_placements: bool = True,
    ) -> tuple[LoadReport, set[str]]:
        """One bucket into the live parameters: its tensors received through their transport
        (checked against the refit info), loaded through the engine's loaders, their
        placements learned (`learn_placements`), the bucket released to the sender. A tensor
        the refit check did not map (an engine that learns where tensors land while loading)
        is loaded alone, and the parameters the engine's `load_fn` says it wrote are kept as
        its map. With `keep_previous`, what the bucket overwrites is kept first (once per
        update) for `restore_previous`. Returns the report and the parameters written."""
        start = time.perf_counter()
        loader_before = self.buckets.loader_tensors
        views = self.receive(descriptor)
        param_of = self.param_of
        self._loaded.add(descriptor.index)
        mapped = self._mapped.get(descriptor.index)
        if not descriptor.handle.get("same"):
            self._mapped.pop(descriptor.index, None)  # its views changed
            mapped = None
        if mapped is not None and mapped[0] is views and mapped[1] is param_of:
            known, written = views, set(mapped[2])  # a replayed bucket, every tensor mapped
        else:
            known = [(n, t) for n, t in views if n in param_of]
            if len(known) == len(views):
                known = views  # the very list received: a replayed bucket's copies are reused
            written = None
        if keep_previous:
            if len(known) < len(views):  # where a new tensor lands is not known yet
                self.previous.keep_all(dict(self.model.named_parameters()))
            self.previous.keep([name for name, _ in known])
        if known:
            self.buckets.load(known)
        if written is None:
            written = {param for name, _ in known for param in param_of[name]}
            for name, tensor in views:
                if name not in param_of:
                    self.buckets.loader_tensors += 1
                    param_of[name] = sorted(self.load_fn([(name, tensor)]) or ())
                    written.update(param_of[name])
            if known is views:  # kept while the bucket is replayed (`receive` hands back views)
                self._mapped[descriptor.index] = (views, param_of, frozenset(written))
        loader_tensors = self.buckets.loader_tensors - loader_before  # not the dry runs below
        if learn_placements:
            self.learn_placements(views)
        num_tensors = len(views)  # a replayed bucket's descriptor lists none
        del views, known
        released = self.release(descriptor)
        report = LoadReport(
            num_tensors=num_tensors,
            nbytes=descriptor.nbytes,
            seconds=time.perf_counter() - start,
            released=released,
            loader_tensors=loader_tensors,
        )
        return report, written

    def release(self, descriptor: BucketDescriptor) -> dict[str, Any] | None:
        return self.buckets.release(descriptor)

    def restore_previous(self) -> int:
        """Put back what this update overwrote; how many parameters that was.

        During a one-copy update trainer ranks may still be writing into the shared parameters
        (an update that expired while a rank was slow): copying the old bytes back there would
        serve whatever those ranks write next. So the parameters leave the shared memory first
        (fenced): each takes its kept copy as its own memory, the writers are left with a
        segment nobody reads, and the next sync goes by buckets and shares again."""
        self._prints.forget()  # parameters may take other memory
        if not self._writing:
            return self.previous.restore()
        self._writing = False
        restored = self.previous.restore(fence=True)
        self.sharing.release()
        return restored

    def drop_previous(self) -> None:
        self.previous.drop()

    def open_update(self) -> None:
        """A new update opens on this worker (an earlier one ended or was aborted): its kept
        previous weights go, and a one-copy `begin_one_copy` this worker accepted while another
        worker of the engine refused it (nothing was written) no longer counts as writing, so a
        later rollback does not fence the parameters off."""
        self._writing = False
        self.previous.drop()
        # Replayed buckets' kept views: only those the last update loaded (the others may be
        # of segments or senders the transport let go; kept, they would stay mapped).
        self._mapped = {i: m for i, m in self._mapped.items() if i in self._loaded}
        self._loaded = set()
        self._pools.clear()  # learning is the first sync's: its random bytes go

    def learn_placements(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """After loading: for each tensor seen for the first time that lands in one parameter,
        where the loader puts its elements (weightsync/wire/placement.py; on a scratch copy,
        the live weights are not touched). The tensors of one parameter are learned together
        (`learn_placements`: a few loads of all of them, not a few each)."""
        from weightsync.engine.one_copy.segment import WholePlacements
        from weightsync.wire.placement import learn_placements

        by_param: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in named_tensors:
            targets = self.param_of.get(name, [])
            if name in self.placements or name in self._unplaced or len(targets) != 1:
                continue
            by_param.setdefault(targets[0], []).append((name, tensor))
        if not by_param:
            return
        params = dict(self.model.named_parameters())
        specs = self.refit.accepted
        names = {p: [n for n, _ in pairs if n in specs] for p, pairs in by_param.items()}
        # Whole tensors first (guessed back to back for many parameters in one load, from
        # where an earlier bucket's tensors of the parameter end; else one load a parameter).
        whole = WholePlacements(specs, names.values()).place_all(
            params,
            names,
            self.buckets.load,
            {p: self._ends[p] for p in names if p in self._ends},
            self._pools,
        )
        ends = self._ends
        sizes = {p: params[p].element_size() for p in names}
        for name, (pname, at) in whole.items():
            spec = specs[name]
            self.placements[name] = [pname, [[at, 0, spec.numel, 1, 0, 0]]]
            end = (at * sizes[pname] + spec.nbytes + 7) & ~7
            if end > ends.get(pname, 0):
                ends[pname] = end
        for pname, pairs in by_param.items():
            # The rest element by element.
            pairs = [(n, t) for n, t in pairs if n not in whole]
            if not pairs:
                continue

            def load(chosen: list[tuple[int, torch.Tensor]], pairs: list = pairs) -> None:
                self.buckets.load([(pairs[i][0], t) for i, t in chosen])

            learned = learn_placements(
                params[pname], [(t.dtype, tuple(t.shape)) for _, t in pairs], load
            )
            for (name, _), pats in zip(pairs, learned):
                if pats is None:
                    self._unplaced.add(name)
                else:
                    self.placements[name] = [pname, pats]

    def share(self, placements: dict[str, Any] | None = None) -> ShareAnswer:
        """`ParameterSharing.share`; without `placements` (one worker holds whole tensors),
        the tensors whose whole verbatim placement was learned while loading are not probed
        again (`learn_placements` checked those copies with random bytes)."""
        self._prints.forget()  # the parameters move into shared memory
        return self.sharing.share(placements, None if placements else self.whole_destinations())

    def whole_destinations(self) -> dict[str, tuple[str, int]]:
        """{tensor: (parameter, byte offset)} of the learned placements that put a tensor whole
        and in order into its parameter."""
        from weightsync.wire.placement import whole_offset

        accepted = self.refit.accepted
        sizes: dict[str, int] = {}
        out: dict[str, tuple[str, int]] = {}
        for name, (pname, pats) in self.placements.items():
            spec = accepted.get(name)
            at = None if spec is None else whole_offset(pats, spec.numel)
            if at is None:
                continue
            if pname not in sizes:
                sizes[pname] = self.model.get_parameter(pname).element_size()
            out[name] = (pname, at * sizes[pname])
        return out

    def begin_one_copy(
        self, *, keep_previous: bool, sharing: list[str] | None = None
    ) -> str | None:
        """Before the trainer writes: None if the parameters are where it will write (and, with
        `keep_previous`, copied first), else why not. `sharing`: the sharings the trainer
        writes into (`ParameterSharing.begin`)."""
        why = self.sharing.begin(sharing)
        self._prints.forget()  # one-copy syncs verify by the ranks' read-back, not by these
        if why is None and keep_previous and self.sharing.shared.device is not None:
            why = (
                f"{self.sharing.name}: keep_previous on GPU parameters: the previous weights "
                f"cannot be put back safely under the trainer's writes (weightsync/"
                f"direct_cuda.py); this update takes buckets"
            )
        if why is None and keep_previous:
            self.previous.keep_all(self.sharing.shared.params)
        self._writing = why is None
        return why

    def one_copy_params(self) -> list[str]:
        return self.sharing.params()

    def end_one_copy(self) -> None:
        self._writing = False
        self.sharing.end()

    def fingerprints(self) -> dict[str, list[int]]:
        return self._prints(self.refit.param_of)

    def close(self) -> None:
        self._mapped.clear()
        self.buckets.close()
        self.sharing.close()


def sharing_of(one_copy: bool | list[str]) -> list[str] | None:
    """The sharings a `begin(one_copy=...)` names (None: `one_copy` is a plain flag)."""
    return list(one_copy) if isinstance(one_copy, (list, tuple)) else None
