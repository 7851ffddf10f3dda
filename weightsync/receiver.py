"""The receiving side, inside an engine's model process.

`WeightReceiver` is the interface an engine actor offers the trainer (plain data in and out).
`ModelReceiver` is the engine-independent part of it that runs next to the engine's model: it
checks refit info with a dry run of the engine's own loader, maps transport buffers to views,
loads them with the engine's loader (so fused QKV, transposed Conv1D and tied heads stay the
engine's business), and fingerprints the engine's parameters for verification.

How the dry run works: engines load a tensor by calling `param.weight_loader(param, tensor, ...)`
(or a default loader when the parameter has none). During a check every parameter's loader is
wrapped so the call is recorded (which incoming name reached which parameter) and redirected to
an empty scratch copy of the parameter, so the engine's shape logic runs and raises where a
shape does not fit, yet no engine weight changes. The recorded map also tells verification which
trainer tensors make up each engine parameter.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from weightsync.direct import SharedParameters, probe_destinations
from weightsync.errors import BucketRejected, NotShared
from weightsync.fingerprint import Fingerprint, combine, fingerprint
from weightsync.transports import ReceiverTransport, make_receiver
from weightsync.wire import BucketDescriptor, TensorSpec, dtype_to_str

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
WeightLoader = Callable[..., Any]


class WeightReceiver(ABC):
    """What an engine actor offers the trainer. Every argument and result is plain data.

    Called by the trainer's sending rank only (rank 0 of the trainer group), in this order:
      1. `check_refit(specs)` once per trainer, before any sync; nothing is written.
      2. per sync: `begin(version)`, then `load_bucket(descriptor)` for every bucket in order,
         then `end(version)`; `abort(reason)` instead of `end` when the sender failed.
      3. `fingerprints()` whenever the trainer verifies, usually right after `end`.
    `weight_version()` may be called at any time.
    """

    @abstractmethod
    def check_refit(self, specs: list[dict]) -> dict:
        """Validate the trainer's tensors against the engine's parameters.

        Returns {"param_of": {trainer name: [engine parameter names]}, "num_params": int}.
        Raises ValueError naming the first tensor whose name, shape or dtype the engine rejects.
        """

    @abstractmethod
    def begin(self, version: str, direct: bool = False) -> dict | None:
        """Open an update session (the engine stops taking new requests until `end`).

        With `direct` the trainer will write into the shared parameters (weightsync/direct.py)
        instead of sending buckets; returns {"direct": True}, or {"direct": False, "why": ...}
        without opening anything when the parameters are not (or no longer) shared."""

    @abstractmethod
    def load_bucket(self, descriptor: dict) -> dict:
        """Load one bucket's tensors; returns {"num_tensors", "nbytes", "seconds"}."""

    @abstractmethod
    def end(self, version: str) -> dict:
        """Finish: post-process the weights, reset the prefix cache, adopt `version`."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Close a session that failed; the engine keeps its previous version tag."""

    @abstractmethod
    def fingerprints(self) -> dict[str, list[int]]:
        """{engine parameter name: [s1, s2]} of the weights the engine serves now."""

    @abstractmethod
    def weight_version(self) -> str | None:
        """The version tag of the weights served now (None before the first sync)."""

    def settle(self, timeout_s: float = 120.0) -> dict:
        """Wait for work the engine finishes in the background after an update (none by
        default); reports {"background_s": seconds it took} where there is some."""
        return {}

    def share_params(self) -> dict:
        """Move the parameters into shared memory for the one-copy path, after a first sync;
        {"shared": {"segment", "nbytes", "offsets"} or None, "why": str, "retry": bool}."""
        return {"shared": None, "why": f"{type(self).__name__} has no one-copy path",
                "retry": False}



def _scratch_like(param: torch.Tensor) -> torch.nn.Parameter:
    scratch = torch.nn.Parameter(torch.empty_like(param.data), requires_grad=False)
    for key, value in vars(param).items():
        if key != "weight_loader":
            setattr(scratch, key, value)
    return scratch


class ModelReceiver:
    """Engine-side loading and checking for one model replica (one engine worker process).

    `load_fn` is the engine's own `model.load_weights`; `default_loader` is the engine's loader
    for parameters that carry no `weight_loader` of their own.
    """

    def __init__(self, model: nn.Module, *, load_fn: LoadFn, default_loader: WeightLoader,
                 name: str = "engine") -> None:
        self.model = model
        self.load_fn = load_fn
        self.default_loader = default_loader
        self.name = name
        self.accepted: dict[str, TensorSpec] = {}
        self.param_of: dict[str, list[str]] = {}
        self._transports: dict[str, ReceiverTransport] = {}
        self._previous: dict[str, torch.Tensor] | None = None
        self.shared: SharedParameters | None = None

    # ---- tracing -------------------------------------------------------------------------
    @contextmanager
    def _traced_loaders(self, *, dry_run: bool) -> Iterator[dict[str, Any]]:
        """Wrap every parameter's loader; yields the trace state {"current": name, "hits": {}}."""
        state: dict[str, Any] = {"current": None, "hits": {}}
        params = dict(self.model.named_parameters())
        saved: dict[str, tuple[bool, Any]] = {}

        def make(pname: str, original: WeightLoader) -> WeightLoader:
            def traced(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any):
                incoming = state["current"]
                state["hits"].setdefault(incoming, [])
                if pname not in state["hits"][incoming]:
                    state["hits"][incoming].append(pname)
                target = _scratch_like(param) if dry_run else param
                return original(target, loaded, *args, **kwargs)

            return traced

        try:
            for pname, param in params.items():
                has = "weight_loader" in vars(param)
                original = vars(param).get("weight_loader", self.default_loader)
                saved[pname] = (has, vars(param).get("weight_loader"))
                param.weight_loader = make(pname, original)
            yield state
        finally:
            for pname, (has, original) in saved.items():
                param = params[pname]
                if has:
                    param.weight_loader = original
                else:
                    del param.weight_loader

    def _feed(self, state: dict[str, Any],
              tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            state["current"] = name
            yield name, tensor

    # ---- refit check ---------------------------------------------------------------------
    def check_refit(self, specs: list[TensorSpec]) -> dict[str, Any]:
        """Dry-run the engine's loader on empty tensors of the trainer's specs; see module doc."""
        if not specs:
            raise ValueError(f"{self.name}: the trainer offers no tensors (an empty model?)")
        params = dict(self.model.named_parameters())
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            dup = sorted({s.name for s in specs if sum(t.name == s.name for t in specs) > 1})
            raise ValueError(f"{self.name}: tensors named twice in refit info: {dup}")
        # Materialising tensors happens lazily, one at a time, inside the engine's loader.
        from weightsync.wire import dtype_from_str

        def empties() -> Iterator[tuple[str, torch.Tensor]]:
            for spec in specs:
                yield spec.name, torch.zeros(spec.shape, dtype=dtype_from_str(spec.dtype))

        with self._traced_loaders(dry_run=True) as state:
            try:
                self.load_fn(self._feed(state, empties()))
            except Exception as exc:  # the engine's loader rejected a tensor
                name = state["current"]
                spec = by_name.get(name)
                targets = state["hits"].get(name) or []
                shapes = ", ".join(f"{p} {tuple(params[p].shape)}" for p in targets if p in params)
                raise ValueError(
                    f"{self.name}: tensor {name!r} (trainer shape "
                    f"{spec.shape if spec else '?'}, dtype {spec.dtype if spec else '?'}) was "
                    f"rejected by the engine's loader"
                    + (f" for engine parameter {shapes}" if shapes else "")
                    + f": {type(exc).__name__}: {exc}"
                ) from None
        hits: dict[str, list[str]] = {k: v for k, v in state["hits"].items() if k is not None}
        missing = [s.name for s in specs if s.name not in hits]
        if missing:
            raise ValueError(
                f"{self.name}: the engine's model has no parameter for {len(missing)} trainer "
                f"tensor(s), e.g. {missing[:5]}; check the model architecture and HF naming"
            )
        for spec in specs:
            for pname in hits[spec.name]:
                engine_dtype = dtype_to_str(params[pname].dtype)
                if engine_dtype != spec.dtype:
                    raise ValueError(
                        f"{self.name}: tensor {spec.name!r}: trainer dtype {spec.dtype} != "
                        f"engine dtype {engine_dtype} (parameter {pname!r}); send "
                        f"{engine_dtype} (the worker's dtype= option)"
                    )
        covered = {p for targets in hits.values() for p in targets}
        uncovered = sorted(set(params) - covered)
        if uncovered:
            raise ValueError(
                f"{self.name}: {len(uncovered)} engine parameter(s) would get no trainer tensor, "
                f"e.g. {uncovered[:5]}; a sync would leave them stale"
            )
        self.accepted = by_name
        self.param_of = hits
        return {"param_of": hits, "num_params": len(params)}

    # ---- loading -------------------------------------------------------------------------
    def _transport(self, kind: str) -> ReceiverTransport:
        transport = self._transports.get(kind)
        if transport is None:
            transport = self._transports[kind] = make_receiver(kind)
        return transport

    def check_descriptor(self, descriptor: BucketDescriptor) -> None:
        """Every tensor of the bucket was accepted by check_refit, with the same dtype/shape."""
        if not self.accepted:
            raise BucketRejected(f"{self.name}: load before check_refit; call check_refit first")
        for meta in descriptor.tensors:
            spec = self.accepted.get(meta.name)
            if spec is None:
                raise BucketRejected(f"{self.name}: bucket {descriptor.index} carries {meta.name!r}, "
                                 f"which refit info did not announce")
            if spec.shape != meta.shape or spec.dtype != meta.dtype:
                raise BucketRejected(
                    f"{self.name}: tensor {meta.name!r}: bucket has {meta.dtype} {meta.shape}, "
                    f"refit info announced {spec.dtype} {spec.shape}"
                )

    def receive(self, descriptor: BucketDescriptor) -> list[tuple[str, torch.Tensor]]:
        """Views of one bucket's tensors, after checking them against refit info."""
        self.check_descriptor(descriptor)
        return self._transport(descriptor.handle["kind"]).receive_tensors(descriptor)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], *,
             keep_previous: bool = False) -> None:
        """Load through the engine's loaders. With `keep_previous`, first copy every parameter
        these tensors land in (once per update), so that `restore_previous()` can undo it."""
        if keep_previous:
            self._keep_previous([name for name, _ in named_tensors])
        self.load_fn(iter(named_tensors))

    # ---- keeping the previous weights (costs one copy of what an update touches) ---------------
    def _keep_previous(self, names: list[str]) -> None:
        if self._previous is None:
            self._previous = {}
        params = dict(self.model.named_parameters())
        for name in names:
            targets = self.param_of.get(name)
            if targets is None:
                raise RuntimeError(f"{self.name}: cannot keep the previous weights of {name!r}: "
                                   f"its parameters are unknown (check_refit first)")
            for pname in targets:
                if pname not in self._previous:
                    self._previous[pname] = params[pname].detach().clone()

    def restore_previous(self) -> int:
        """Put back what `load(..., keep_previous=True)` overwrote in this update; how many
        parameters that was."""
        previous, self._previous = self._previous or {}, None
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for pname, saved in previous.items():
                params[pname].copy_(saved)
        return len(previous)

    def drop_previous(self) -> None:
        """The update is complete: forget the copies."""
        self._previous = None

    def release(self, descriptor: BucketDescriptor) -> None:
        self._transport(descriptor.handle["kind"]).release(descriptor.handle)

    # ---- the one-copy path (weightsync/direct.py) -----------------------------------------------
    def share(self) -> dict[str, Any]:
        """Move the parameters into shared memory for the trainer to write; once, after a first
        sync by buckets (the loader must have shown where every tensor goes). Returns
        {"shared": plain description or None, "why": reason when None}."""
        if self.shared is not None:
            try:
                self.shared.check()
                return {"shared": self.shared.describe(), "why": None, "retry": False}
            except NotShared:
                self.shared.close()
                self.shared = None
        unknown = sorted(set(self.accepted) - set(self.param_of))
        if not self.accepted or unknown:
            return {"shared": None, "retry": True,
                    "why": f"{self.name}: where {len(unknown)} tensor(s) land is not known yet "
                           f"(sync by buckets first)"}
        params = dict(self.model.named_parameters())
        destinations = probe_destinations(
            params, self.param_of, self.accepted,
            lambda name, tensor: self.load_fn(iter([(name, tensor)])))
        indirect = sorted(set(self.accepted) - set(destinations))
        if indirect:
            return {"shared": None, "retry": False,
                    "why": f"{self.name}: the loader does not copy {len(indirect)} tensor(s) "
                           f"verbatim into one parameter, e.g. {indirect[:3]}"}
        self.shared = SharedParameters(params, destinations)
        logger.info("%s: %d parameters moved into shared segment %s (%d bytes)", self.name,
                    len(self.shared.params), self.shared.segment.name, self.shared.segment.nbytes)
        return {"shared": self.shared.describe(), "why": None, "retry": False}

    def begin_direct(self, *, keep_previous: bool) -> str | None:
        """Before the trainer writes: None if the parameters are where it will write (and, with
        `keep_previous`, copied first), else why not."""
        if self.shared is None:
            return f"{self.name}: parameters are not shared"
        try:
            self.shared.check()
        except NotShared as exc:
            return str(exc)
        if keep_previous:
            self._previous = {p: param.detach().clone() for p, param in self.shared.params.items()}
        return None

    def direct_params(self) -> list[str]:
        return sorted(self.shared.params) if self.shared is not None else []

    def end_direct(self) -> None:
        """After the trainer wrote: raise `NotShared` unless every shared parameter still is
        the bytes it wrote (something may have replaced one meanwhile)."""
        if self.shared is None:
            raise NotShared(f"{self.name}: parameters are not shared")
        self.shared.check()

    # ---- verification --------------------------------------------------------------------
    def fingerprints(self) -> dict[str, list[int]]:
        covered = {p for targets in self.param_of.values() for p in targets}
        return {name: list(fingerprint(p.data)) for name, p in self.model.named_parameters()
                if name in covered}

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
        if self.shared is not None:
            self.shared.close()


def expected_fingerprints(param_of: dict[str, list[str]],
                          sent: dict[str, Fingerprint]) -> dict[str, Fingerprint]:
    """What each engine parameter's fingerprint must be, from the trainer tensors' fingerprints.

    A trainer tensor that lands in several engine parameters cannot be checked this way and is
    left out (its parameters are then compared through their other tensors only if exclusive).
    """
    parts: dict[str, list[Fingerprint]] = {}
    shared: set[str] = set()
    for name, targets in param_of.items():
        if len(targets) != 1:
            shared.update(targets)
            continue
        parts.setdefault(targets[0], []).append(tuple(sent[name]))
    return {p: combine(prints) for p, prints in parts.items() if p not in shared}


def copy_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """The plainest engine loader: shapes must match exactly."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class ModuleWeightReceiver(WeightReceiver):
    """A `WeightReceiver` for a plain torch module whose parameters carry the senders' names.

    The reference receiver: what an engine's loader does, with nothing engine-specific (used by
    the core tests and the GPU transport benchmarks).
    """

    def __init__(self, model: nn.Module, *, name: str = "module") -> None:
        params = dict(model.named_parameters())

        def load_fn(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for pname, tensor in weights:
                param = params.get(pname)
                if param is not None:
                    getattr(param, "weight_loader", copy_loader)(param, tensor)

        self.receiver = ModelReceiver(model, load_fn=load_fn, default_loader=copy_loader,
                                      name=name)
        self._version: str | None = None
        self._session: str | None = None
        self._direct = False

    def check_refit(self, specs: list[dict]) -> dict:
        from weightsync.wire import specs_from_dicts

        return self.receiver.check_refit(specs_from_dicts(specs))

    def begin(self, version: str, direct: bool = False) -> dict:
        if self._session is not None:
            raise RuntimeError(f"update session {self._session!r} is still open")
        if direct:
            why = self.receiver.begin_direct(keep_previous=False)
            if why is not None:
                return {"direct": False, "why": why}
        self._session, self._direct = version, direct
        return {"direct": direct}

    def share_params(self) -> dict:
        return self.receiver.share()

    def load_bucket(self, descriptor: dict) -> dict:
        start = time.perf_counter()
        bucket = BucketDescriptor.from_dict(descriptor)
        if self._session is None:
            raise RuntimeError("load_bucket outside an update session; call begin first")
        views = self.receiver.receive(bucket)
        self.receiver.load(views)
        del views
        self.receiver.release(bucket)
        return {"num_tensors": len(bucket.tensors), "nbytes": bucket.nbytes,
                "seconds": time.perf_counter() - start}

    def end(self, version: str) -> dict:
        if self._session != version:
            raise RuntimeError(f"end({version!r}) but the open session is {self._session!r}")
        if self._direct:
            self.receiver.end_direct()
        self._session = None
        self._version = version
        return {"weight_version": version}

    def abort(self, reason: str) -> None:
        self._session = None

    def fingerprints(self) -> dict[str, list[int]]:
        return self.receiver.fingerprints()

    def weight_version(self) -> str | None:
        return self._version


def checkpoint_specs(path: str) -> dict[str, TensorSpec]:
    """Name, dtype and shape of every tensor in a safetensors checkpoint directory (headers
    only; nothing is loaded)."""
    import glob
    import os

    from safetensors import safe_open

    dtypes = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64",
              "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}; cannot check refit info")
    specs: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                specs[name] = TensorSpec(name=name, dtype=dtypes.get(piece.get_dtype(), "?"),
                                         shape=tuple(piece.get_shape()))
    return specs


def check_against_checkpoint(specs: list[TensorSpec], path: str, *, engine_dtype: str,
                             name: str = "engine") -> None:
    """Refit check for engines without a dry run: the trainer's tensors must be the ones the
    engine was started from (same names and shapes), in the engine's dtype."""
    known = checkpoint_specs(path)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"{name}: tensor {spec.name!r} appears twice in refit info")
        seen.add(spec.name)
        ref = known.get(spec.name)
        if ref is None:
            raise ValueError(f"{name}: the engine's model has no parameter for trainer tensor "
                             f"{spec.name!r}; check the model architecture and HF naming")
        if ref.shape != spec.shape:
            raise ValueError(f"{name}: tensor {spec.name!r}: trainer shape {spec.shape} != "
                             f"engine shape {ref.shape}")
        if spec.dtype != engine_dtype:
            raise ValueError(f"{name}: tensor {spec.name!r}: trainer dtype {spec.dtype} != "
                             f"engine dtype {engine_dtype}; send {engine_dtype} (the worker's "
                             f"dtype= option)")
    # A tied head is stored once by the engine and is not sent.
    missing = sorted(set(known) - seen - {"lm_head.weight"})
    if missing:
        raise ValueError(f"{name}: {len(missing)} engine tensor(s) would get no trainer tensor, "
                         f"e.g. {missing[:5]}; a sync would leave them stale")
    if not specs:
        raise ValueError(f"{name}: the trainer offers no tensors (an empty model?)")


class EngineSession(WeightReceiver):
    """The update-session rules every engine actor follows, around engine-specific hooks.

    One update is open at a time; one still open when the next `begin` arrives was left by a
    sender that died, and is aborted. So is one whose sender has made no call for
    `idle_timeout_s` (checked whenever the engine is asked to serve or report its version):
    nothing waits on a sender that is gone. An update aborted once weights may be mixed leaves
    the engine refusing requests (`check_serving`) until a later sync completes, unless the
    engine kept and put back its previous weights (SGLang's `keep_previous=True`): then it goes on
    serving the previous version. Subclasses implement `_engine_begin`, `_engine_load`, `_engine_end`
    (returns extra report fields) and `_engine_abort` (returns whether weights may now be mixed:
    true once a bucket was loaded, unless the engine put its previous weights back).
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

    @abstractmethod
    def _engine_begin(self, direct: bool) -> str | None:
        """Open the engine's side of an update; with `direct`, return why the trainer cannot
        write into the parameters (then nothing is left open), or None."""

    @abstractmethod
    def _engine_load(self, descriptor: dict) -> dict: ...

    @abstractmethod
    def _engine_end(self, version: str) -> dict: ...

    @abstractmethod
    def _engine_abort(self, reason: str) -> bool: ...

    def begin(self, version: str, direct: bool = False) -> dict:
        if self._open is not None:
            # Only one trainer drives an engine: an update still open means its sender died.
            self.abort(f"update {self._open!r} never ended; a new update {version!r} began")
        self._loaded = 0
        self._begin_t = self._last_call = time.perf_counter()
        why = self._engine_begin(direct)
        if why is not None:
            return {"direct": False, "why": why}
        self._open, self._direct = version, direct
        if direct:
            self._loaded = 1  # the trainer writes into the parameters from now on
        return {"direct": direct}

    def load_bucket(self, descriptor: dict) -> dict:
        if self._open is None:
            raise RuntimeError(f"{self.engine_name}: load_bucket outside an update; call begin "
                               f"first")
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
        return result

    def end(self, version: str) -> dict:
        if self._open != version:
            raise RuntimeError(f"{self.engine_name}: end({version!r}) but the open update is "
                               f"{self._open!r}")
        start = time.perf_counter()
        extra = self._engine_end(version)
        self._open, self._broken, self._version = None, None, version
        return {"weight_version": version, "end_s": time.perf_counter() - start,
                "session_s": time.perf_counter() - self._begin_t, **extra}

    def abort(self, reason: str) -> None:
        if self._open is not None:
            logger.warning("%s: update %r aborted: %s", self.engine_name, self._open, reason)
            if self._engine_abort(reason):
                done = ("the trainer began writing into the parameters" if self._direct
                        else f"{self._loaded} bucket(s)")
                self._broken = f"update {self._open!r} was aborted after {done} ({reason}); " \
                               f"sync again"
        self._open = None

    def weight_version(self) -> str | None:
        self._expire_idle()
        return self._version

    def _expire_idle(self) -> None:
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
