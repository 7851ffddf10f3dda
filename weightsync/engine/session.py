"""The receiving side: what an engine offers the trainer, and its engine-independent parts.

`WeightReceiver` is the interface an engine actor offers the trainer (plain data in and out: each
answer is one of weightsync/wire/protocol.py's classes, as its `to_dict()`);
`EngineSession` holds the update-session rules every engine actor follows around its own hooks.
`ModelReceiver` is what runs next to the engine's model (in its worker process), put together
from one part per job, each in its own module:
  weightsync/engine/refit.py        the refit check, a dry run of the engine's own loader
  weightsync/engine/loading.py      buckets from their transports into the engine's loader
  weightsync/engine/rollback.py     the previous weights, kept during an update to put back
  weightsync/engine/one_copy/sharing.py      the one-copy path: parameters shared with the trainer
  weightsync/wire/fingerprint.py  the engine parameters' fingerprints, for verification
`ModuleWeightReceiver` is the reference receiver for a plain torch module.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from weightsync.wire.errors import BucketRejected
from weightsync.wire.fingerprint import model_fingerprints
from weightsync.engine.loading import BucketLoader
from weightsync.wire.protocol import (
    BeginAnswer,
    EndReport,
    LoadReport,
    RefitAnswer,
    SettleReport,
    ShareAnswer,
    StageReport,
)
from weightsync.engine.refit import RefitCheck, copy_loader
from weightsync.engine.rollback import PreviousWeights
from weightsync.engine.one_copy.sharing import ParameterSharing
from weightsync.wire.specs import BucketDescriptor, specs_from_dicts

if TYPE_CHECKING:
    import torch
    from torch import nn

    from weightsync.engine.refit import LoadFn, WeightLoader
    from weightsync.wire.specs import TensorSpec

logger = logging.getLogger(__name__)


class WeightReceiver(ABC):
    """What an engine actor offers the trainer. Every argument and result is plain data.

    Called by the trainer's sending rank only (rank 0 of the trainer group), in this order:
      1. `check_refit(specs)` once per trainer, before any sync; nothing is written.
      2. per sync: `begin(version)`, then `load_bucket(descriptor)` for every bucket in order,
         then, when the sync is verified, `stage(version)`, then `end(version)`;
         `abort(reason)` instead of `end` when the sender failed or verification did.
      3. `fingerprints()` / `worker_fingerprints()` whenever the trainer verifies outside a sync.
    `weight_version()` may be called at any time.
    These methods are where answers go on the wire: each builds its weightsync/wire/protocol.py
    answer and returns its `to_dict()`.
    """

    @abstractmethod
    def check_refit(self, specs: list[dict]) -> dict:
        """Validate the trainer's tensors against the engine's parameters: a `RefitAnswer`.

        Raises ValueError naming the first tensor whose name, shape or dtype the engine rejects.
        """

    @abstractmethod
    def begin(self, version: str, direct: bool | list[str] = False) -> dict:
        """Open an update session (the engine stops taking new requests until `end`): a
        `BeginAnswer`.

        With `direct` the trainer will write into the shared parameters (weightsync/trainer/one_copy/targets.py)
        instead of sending buckets; the answer says `direct=False` and why, without opening
        anything, when the parameters are not (or no longer) shared. `direct` as a list names
        the sharings the trainer holds mapped (each worker's segment name or CUDA export owner,
        `sharing_of`): a worker whose parameters are shared otherwise now answers why not."""

    @abstractmethod
    def load_bucket(self, descriptor: dict) -> dict:
        """Load one bucket's tensors: a `LoadReport`."""

    @abstractmethod
    def end(self, version: str) -> dict:
        """Finish: post-process the weights, reset the prefix cache, adopt `version`: an
        `EndReport`."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Close a session that failed; the engine keeps its previous version tag."""

    @abstractmethod
    def fingerprints(self) -> dict[str, list[int]]:
        """{engine parameter name: [s, h1, h2]} of the weights the engine holds now
        (weightsync/wire/fingerprint.py)."""

    def stage(self, version: str) -> dict:
        """Inside the open update `version`, after its last bucket: what it holds, for
        verification before the engine adopts it: a `StageReport`. This default reports
        `fingerprints()` without placements (checked by name)."""
        return StageReport(fingerprints=[self.fingerprints()]).to_dict()

    @abstractmethod
    def weight_version(self) -> str | None:
        """The version tag of the weights served now (None before the first sync)."""

    def settle(self, timeout_s: float = 120.0) -> dict:
        """Wait for work the engine finishes in the background after an update (none by
        default): a `SettleReport`."""
        return SettleReport().to_dict()

    def share_params(self) -> dict:
        """Move the parameters into shared memory for the one-copy path, after a first sync:
        a `ShareAnswer`."""
        return ShareAnswer(shared=None,
                           why=f"{type(self).__name__} has no one-copy path").to_dict()


class ModelReceiver:
    """Receiving weights into one model replica (one engine worker process): the parts the
    module doc lists, put together. The engine's backend calls it in `WeightReceiver`'s order: `check_refit`
    once; per bucket `receive`, `load`, `release`; per one-copy update `begin_direct`, then
    `end_direct`; `fingerprints` to verify.

    `load_fn` is the engine's own `model.load_weights`; `default_loader` is the engine's loader
    for parameters that carry no `weight_loader` of their own.
    """

    def __init__(self, model: nn.Module, *, load_fn: LoadFn, default_loader: WeightLoader,
                 name: str = "engine") -> None:
        self.model = model
        self.name = name
        self.refit = RefitCheck(model, load_fn=load_fn, default_loader=default_loader,
                                name=name)
        self.buckets = BucketLoader(self.refit, load_fn=load_fn, name=name)
        self.previous = PreviousWeights(model, self.refit, name=name)
        self.sharing = ParameterSharing(model, self.refit, load_fn=load_fn, name=name)
        # Trainer tensor -> [parameter, patterns] (`learn_placements`): for verification, and
        # at TP > 1 for the one-copy path's slices
        self.placements: dict[str, list] = {}
        self._unplaced: set[str] = set()
        self._writing = False  # a one-copy update is open: trainer ranks write the parameters

    @property
    def param_of(self) -> dict[str, list[str]]:
        """Trainer tensor name -> the engine parameters it lands in."""
        return self.refit.param_of

    def check_refit(self, specs: list[TensorSpec]) -> RefitAnswer:
        return self.refit.check(specs)

    def receive(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        return self.buckets.receive(descriptor)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], *,
             keep_previous: bool = False) -> None:
        """Load through the engine's loaders. With `keep_previous`, first copy every parameter
        these tensors land in (once per update), so that `restore_previous()` can undo it."""
        if keep_previous:
            self.previous.keep([name for name, _ in named_tensors])
        self.buckets.load(named_tensors)

    def release(self, descriptor: BucketDescriptor) -> None:
        self.buckets.release(descriptor)

    def restore_previous(self) -> int:
        """Put back what this update overwrote; how many parameters that was.

        During a one-copy update trainer ranks may still be writing into the shared parameters
        (an update that expired while a rank was slow): copying the old bytes back there would
        serve whatever those ranks write next. So the parameters leave the shared memory first
        (fenced): each takes its kept copy as its own memory, the writers are left with a
        segment nobody reads, and the next sync goes by buckets and shares again."""
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
        previous weights go, and a one-copy `begin_direct` this worker accepted while another
        worker of the engine refused it (nothing was written) no longer counts as writing, so a
        later rollback does not fence the parameters off."""
        self._writing = False
        self.previous.drop()

    def learn_placements(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """After loading: for each tensor seen for the first time
        that lands in one parameter, where the loader puts its elements
        (weightsync/wire/placement.py; on a scratch copy, the live weights are not touched)."""
        from weightsync.wire.placement import learn_placement

        params = None
        for name, tensor in named_tensors:
            targets = self.param_of.get(name, [])
            if name in self.placements or name in self._unplaced or len(targets) != 1:
                continue
            params = params or dict(self.model.named_parameters())
            pats = learn_placement(params[targets[0]], tensor.dtype, tuple(tensor.shape),
                                   lambda t, name=name: self.buckets.load([(name, t)]))
            if pats is None:
                self._unplaced.add(name)
            else:
                self.placements[name] = [targets[0], pats]

    def share(self, placements: dict[str, Any] | None = None) -> ShareAnswer:
        return self.sharing.share(placements)

    def begin_direct(self, *, keep_previous: bool,
                     sharing: list[str] | None = None) -> str | None:
        """Before the trainer writes: None if the parameters are where it will write (and, with
        `keep_previous`, copied first), else why not. `sharing`: the sharings the trainer
        writes into (`ParameterSharing.begin`)."""
        why = self.sharing.begin(sharing)
        if why is None and keep_previous and self.sharing.shared.device is not None:
            why = (f"{self.sharing.name}: keep_previous on GPU parameters: the previous weights "
                   f"cannot be put back safely under the trainer's writes (weightsync/"
                   f"direct_cuda.py); this update takes buckets")
        if why is None and keep_previous:
            self.previous.keep_all(self.sharing.shared.params)
        self._writing = why is None
        return why

    def direct_params(self) -> list[str]:
        return self.sharing.params()

    def end_direct(self) -> None:
        self._writing = False
        self.sharing.end()

    def fingerprints(self) -> dict[str, list[int]]:
        return model_fingerprints(self.model, self.refit.param_of)

    def close(self) -> None:
        self.buckets.close()
        self.sharing.close()


def sharing_of(direct: bool | list[str]) -> list[str] | None:
    """The sharings a `begin(direct=...)` names (None: `direct` is a plain flag)."""
    return list(direct) if isinstance(direct, (list, tuple)) else None


def _fused_loader(param: torch.Tensor, loaded: torch.Tensor, start: int) -> None:
    """Copy `loaded` into `param`'s elements from `start` on (one of a fused parameter's
    members)."""
    if start + loaded.numel() > param.numel():
        raise ValueError(f"{tuple(loaded.shape)} from element {start} overruns a parameter of "
                         f"{param.numel()} elements")
    param.data.view(-1)[start:start + loaded.numel()].copy_(loaded.reshape(-1))


class ModuleWeightReceiver(WeightReceiver):
    """A `WeightReceiver` for a plain torch module whose parameters carry the senders' names.

    The reference receiver: what an engine's loader does, with nothing engine-specific (used by
    the core tests and the GPU transport benchmarks).
    """

    def __init__(self, model: nn.Module, *, name: str = "module", sliced: bool = False,
                 fused: dict[str, tuple[str, int]] | None = None) -> None:
        """`sliced`: the parameters' loaders keep a slice of each tensor (a tensor-parallel
        worker's): the receiver learns its placements and reports them at `end`. `fused`:
        where the loader puts tensors, as engines fuse q/k/v or experts into one parameter
        ({tensor: (parameter, first element)}, weightsync/apps/layouts.py `fused`, which lists every
        tensor, an unfused one at element 0 of its own parameter)."""
        self.sliced = sliced
        params = dict(model.named_parameters())
        fused = fused or {}
        for into, _ in fused.values():  # as an engine's fused parameters carry their loader
            params[into].weight_loader = _fused_loader

        def load_fn(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for pname, tensor in weights:
                if pname in fused:
                    into, start = fused[pname]
                    params[into].weight_loader(params[into], tensor, start)
                    continue
                param = params.get(pname)
                if param is not None:
                    getattr(param, "weight_loader", copy_loader)(param, tensor)

        self.receiver = ModelReceiver(model, load_fn=load_fn, default_loader=copy_loader,
                                      name=name)
        # load_fn hands each unfused tensor to the parameter of its name: plain copies may be
        # batched.
        self.receiver.buckets.plain_copies = not fused
        self._version: str | None = None
        self._session: str | None = None
        self._direct = False

    def check_refit(self, specs: list[dict]) -> dict:
        return self.receiver.check_refit(specs_from_dicts(specs)).to_dict()

    def begin(self, version: str, direct: bool | list[str] = False) -> dict:
        if self._session is not None:
            raise RuntimeError(f"update session {self._session!r} is still open")
        if direct:
            why = self.receiver.begin_direct(keep_previous=False, sharing=sharing_of(direct))
            if why is not None:
                return BeginAnswer(direct=False, why=why).to_dict()
        self._session, self._direct = version, bool(direct)
        return BeginAnswer(direct=bool(direct)).to_dict()

    def share_params(self) -> dict:
        return self.receiver.share().to_dict()

    def load_bucket(self, descriptor: dict) -> dict:
        start = time.perf_counter()
        bucket = BucketDescriptor.from_dict(descriptor)
        if self._session is None:
            raise RuntimeError("load_bucket outside an update session; call begin first")
        views = self.receiver.receive(bucket)
        num_tensors = len(views)
        self.receiver.load(views)
        if self.sliced:
            self.receiver.learn_placements(views)
        del views
        self.receiver.release(bucket)
        return LoadReport(num_tensors=num_tensors, nbytes=bucket.nbytes,
                          seconds=time.perf_counter() - start).to_dict()

    def end(self, version: str) -> dict:
        if self._session != version:
            raise RuntimeError(f"end({version!r}) but the open session is {self._session!r}")
        if self._direct:
            self.receiver.end_direct()
        self._session = None
        self._version = version
        placements = [self.receiver.placements] if self.sliced else None
        return EndReport(weight_version=version, placements=placements).to_dict()

    def abort(self, reason: str) -> None:
        self._session = None

    def stage(self, version: str) -> dict:
        if self._session != version:
            raise RuntimeError(f"stage({version!r}) but the open session is {self._session!r}")
        placements = [self.receiver.placements] if self.sliced else None
        return StageReport(fingerprints=[self.receiver.fingerprints()],
                           placements=placements).to_dict()

    def fingerprints(self) -> dict[str, list[int]]:
        return self.receiver.fingerprints()

    def worker_fingerprints(self) -> list[dict[str, list[int]]]:
        return [self.receiver.fingerprints()]

    def weight_version(self) -> str | None:
        return self._version


class EngineSession(WeightReceiver):
    """The update-session rules every engine actor follows, around engine-specific hooks.

    One update is open at a time; one still open when the next `begin` arrives was left by a
    sender that died, and is aborted. So is one whose sender has made no call for
    `idle_timeout_s` (checked whenever the engine is asked to serve or report its version):
    nothing waits on a sender that is gone. An update aborted once weights may be mixed leaves
    the engine refusing requests (`check_serving`) until a later sync completes, unless the
    engine kept and put back its previous weights (`keep_previous=True`): then it goes on
    serving the previous version. Subclasses implement `_engine_begin`, `_engine_load`,
    `_engine_end` (its report; the session adds the timings) and `_engine_abort` (returns
    whether weights may now be mixed: true once a bucket was loaded, unless the engine put its
    previous weights back). The public methods own these rules and put the answers on the wire.

    Generation is paused while parameters are written or probed: from `begin` until `end` or
    `abort` (idle expiry included; a failed `end` stays paused until then), and around
    `share_params` (which wraps the hook `_engine_share`). `_pause` and `_resume` are the
    hooks; an in-process engine keeps them no-ops, since its actor runs one call at a time and
    its own `generate` refuses during an update, but an engine's HTTP server also serves
    clients that call it directly. Whatever closes the update resumes (`abort` in a `finally`),
    so no error leaves the engine paused once its update is closed. While paused, a watchdog
    expires an update whose sender went silent (`GenerationPause`).
    """

    engine_name = "engine"

    def __init__(self, *, idle_timeout_s: float = 60.0) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s}: must be positive")
        self.idle_timeout_s = idle_timeout_s
        self._version: str | None = None
        self._open: str | None = None
        self._loaded = 0
        self._broken: str | None = None
        self._begin_t = 0.0
        self._last_call = 0.0
        self._direct = False
        # Taken by every method that changes the session, as the watchdog thread calls `abort`.
        self._lock = threading.RLock()
        self._pausing = GenerationPause(self)

    def _pause(self) -> bool:
        """Stop the engine generating before its parameters are written or probed; whether it
        paused (then `_resume` follows). Requests that arrive meanwhile must wait or fail,
        never decode on weights of two versions."""
        return False

    def _resume(self) -> None:
        """Undo `_pause`."""

    def _engine_share(self) -> dict:
        return super().share_params()

    @abstractmethod
    def _engine_begin(self, direct: bool | list[str]) -> str | None:
        """Open the engine's side of an update; with `direct`, return why the trainer cannot
        write into the parameters (then nothing is left open), or None. A list `direct` names
        the sharings the trainer writes into (`sharing_of`: each worker checks its own is one
        of them)."""

    @abstractmethod
    def _engine_load(self, descriptor: dict) -> LoadReport: ...

    @abstractmethod
    def _engine_end(self, version: str) -> EndReport: ...

    @abstractmethod
    def _engine_abort(self, reason: str) -> bool: ...

    def _engine_stage(self) -> StageReport:
        return StageReport(fingerprints=[self.fingerprints()])

    def begin(self, version: str, direct: bool | list[str] = False) -> dict:
        with self._lock:
            if self._open is not None:
                # Only one trainer drives an engine: an update still open means its sender died.
                self.abort(f"update {self._open!r} never ended; a new update {version!r} began")
            self._loaded = 0
            self._begin_t = self._last_call = time.perf_counter()
            self._pause_generation()
            try:
                why = self._engine_begin(direct)
            except BaseException:
                self._resume_generation()
                raise
            if why is not None:
                self._resume_generation()
                return BeginAnswer(direct=False, why=why).to_dict()
            self._open, self._direct = version, bool(direct)
            if direct:
                self._loaded = 1  # the trainer writes into the parameters from now on
            return BeginAnswer(direct=bool(direct)).to_dict()

    def load_bucket(self, descriptor: dict) -> dict:
        with self._lock:
            if self._open is None:
                raise RuntimeError(f"{self.engine_name}: load_bucket outside an update; call "
                                   f"begin first")
            self._last_call = time.perf_counter()
            try:
                result = self._engine_load(descriptor)
            except BucketRejected:
                raise  # refused before any byte was written: the weights are still whole
            except BaseException:
                self._loaded += 1  # it may have been partly written
                raise
            finally:
                self._last_call = time.perf_counter()
            self._loaded += 1
            return result.to_dict()

    def stage(self, version: str) -> dict:
        """Still paused: what the open update holds (`_engine_stage`)."""
        with self._lock:
            if self._open != version:
                raise RuntimeError(f"{self.engine_name}: stage({version!r}) but the open "
                                   f"update is {self._open!r}")
            self._last_call = time.perf_counter()
            try:
                return self._engine_stage().to_dict()
            finally:
                self._last_call = time.perf_counter()

    def end(self, version: str) -> dict:
        with self._lock:
            if self._open != version:
                raise RuntimeError(f"{self.engine_name}: end({version!r}) but the open update "
                                   f"is {self._open!r}")
            start = time.perf_counter()
            # A failed end leaves the update open, and so paused: the sender's `abort` (or the
            # idle expiry) resumes, once the engine's weights are whole or it refuses to serve.
            report = self._engine_end(version)
            self._open, self._broken, self._version = None, None, version
            self._resume_generation()
            return replace(report, end_s=time.perf_counter() - start,
                           session_s=time.perf_counter() - self._begin_t).to_dict()

    def abort(self, reason: str) -> None:
        with self._lock:
            try:
                if self._open is not None:
                    logger.warning("%s: update %r aborted: %s", self.engine_name, self._open,
                                   reason)
                    if self._engine_abort(reason):
                        done = ("the trainer began writing into the parameters" if self._direct
                                else f"{self._loaded} bucket(s)")
                        self._broken = (f"update {self._open!r} was aborted after {done} "
                                        f"({reason}); sync again")
            finally:
                self._open = None
                self._resume_generation()

    def share_params(self) -> dict:
        """Generation is paused while the engine moves its parameters and probes them."""
        with self._lock:
            paused_here = not self._pausing.paused
            self._pause_generation()
            try:
                return self._engine_share()
            finally:
                if paused_here:
                    self._resume_generation()

    def _pause_generation(self) -> None:
        self._pausing.pause()

    def _resume_generation(self) -> None:
        self._pausing.resume()

    def weight_version(self) -> str | None:
        self._expire_idle()
        return self._version

    def _expire_idle(self) -> None:
        with self._lock:
            idle = time.perf_counter() - self._last_call
            if self._open is not None and idle > self.idle_timeout_s:
                self.abort(f"its sender made no call for {idle:.0f} s (idle_timeout_s="
                           f"{self.idle_timeout_s:g}); it is presumed dead")

    def check_serving(self) -> None:
        """Raise unless the engine holds one complete set of weights."""
        self._expire_idle()
        if self._broken:
            raise RuntimeError(f"{self.engine_name} engine does not serve: {self._broken}")
        if self._open:
            raise RuntimeError(f"{self.engine_name} engine does not serve during update "
                               f"{self._open!r}")


class GenerationPause:
    """An `EngineSession`'s generation pause: its `_pause`/`_resume` hooks called once per
    pause, and while paused a watchdog thread that expires an update whose sender went
    silent (`_expire_idle`), so a dead trainer does not leave the server paused until
    someone calls the actor."""

    def __init__(self, session: EngineSession) -> None:
        self.session = session
        self.paused = False
        self._count = 0  # pauses so far: a watchdog serves only its own

    def pause(self) -> None:
        if self.paused:
            return
        self.paused = self.session._pause()
        if self.paused:
            self._count += 1
            threading.Thread(target=self._watch, args=(self._count,), daemon=True,
                             name=f"{self.session.engine_name}-idle-watchdog").start()

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        try:
            self.session._resume()
        except Exception as exc:
            raise RuntimeError(f"{self.session.engine_name}: resuming generation failed "
                               f"({exc}); the engine may stay paused until the next update "
                               f"ends") from exc

    def _watch(self, pause: int) -> None:
        """While pause number `pause` lasts: expire a silent update without waiting for a
        call to the actor."""
        session = self.session
        while True:
            time.sleep(min(1.0, session.idle_timeout_s / 4))
            with session._lock:
                if not self.paused or self._count != pause:
                    return
                try:
                    session._expire_idle()
                except Exception:
                    logger.exception("%s: expiring a silent update failed", session.engine_name)
                    return
