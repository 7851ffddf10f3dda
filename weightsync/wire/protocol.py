"""The protocol above the wire: the answers an engine gives the trainer, as typed objects.

`WeightReceiver`'s methods answer with plain dicts, because that is what crosses between
environments (a Ray call, an HTTP reply, a JSON file). Each answer has one class here; the
receiver builds it and calls `to_dict()` where the answer leaves, the sender calls `from_dict()`
where it arrives (`from_wire`), and everything in between reads attributes. `to_dict()` writes
the keys the wire has always carried, so engines built from other checkouts keep working;
`from_dict()` fills absent optional fields with their defaults, ignores keys it does not know
(a newer peer's), and raises ValueError naming a missing required field.

The sender's own results are typed the same way: `SyncReport` (what one sync did) and
`VerifyReport` (what a verification found, engine by engine). `TrainerSync` returns them on rank
0; a trainer actor returns their `to_dict()` to its driver, which reads them back with
`from_dict()` (`launch.launcher.TrainerGroup.sync`). Fingerprints stay `dict[str, list[int]]`, a
plain mapping already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

_MISSING = object()


def _get(d: Mapping[str, Any], cls: type, name: str, default: Any = _MISSING) -> Any:
    """`d[name]`; without a default, a ValueError naming the field when it is absent."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls.__name__}: expected a dict, got {type(d).__name__}: {d!r:.200}")
    if name in d:
        return d[name]
    if default is _MISSING:
        raise ValueError(
            f"{cls.__name__}: required field {name!r} missing from the answer "
            f"(keys: {sorted(d)}); do both sides run the same weightsync?"
        )
    return default


def _param_of(d: Mapping[str, Any]) -> dict[str, list[str]]:
    return {str(name): list(params) for name, params in d.items()}


def _without_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


Metrics = dict[str, float | int | str]
"""A flat metrics dict (`SyncReport.metrics`, `VerifyReport.metrics`): plain Python scalars,
nothing nested, ready for `wandb.log` or a TensorBoard writer's `add_scalar` per key."""


def _put_seconds(out: Metrics, key: str, seconds: Any) -> None:
    """`out[key] = seconds` as a float, where `seconds` is known."""
    if seconds is not None:
        out[key] = float(seconds)


@dataclass(kw_only=True, slots=True, frozen=True)
class RefitAnswer:
    """`check_refit`'s answer: the engine accepts the trainer's tensors (it raises if not)."""

    param_of: dict[str, list[str]]
    """Trainer tensor name -> the engine parameters it lands in (learned later where absent)."""
    num_params: int
    """How many parameters the engine's model has."""
    num_receivers: int = 1
    """How many processes a sync reaches (an engine's tensor-parallel workers)."""
    tp_size: int = 1
    """The engine's tensor-parallel size."""
    unverifiable: str | None = None
    """Why the engine's weights cannot be read back (a stock engine, updated through its own
    reload: weightsync/engine/stock.py); None when syncs into it can be verified."""
    accepted: list[str] | None = None
    """Forms the engine derived after loading that syncs leave as they were, accepted by
    `SyncOptions.accept_unkept`: each with its layer and the reason given."""

    def to_dict(self) -> dict[str, Any]:
        return _without_none(
            {
                "param_of": _param_of(self.param_of),
                "num_params": self.num_params,
                "num_receivers": self.num_receivers,
                "tp_size": self.tp_size,
                "unverifiable": self.unverifiable,
                "accepted": self.accepted,
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RefitAnswer:
        return cls(
            param_of=_param_of(_get(d, cls, "param_of")),
            num_params=int(_get(d, cls, "num_params")),
            num_receivers=int(_get(d, cls, "num_receivers", 1)),
            tp_size=int(_get(d, cls, "tp_size", 1)),
            unverifiable=_get(d, cls, "unverifiable", None),
            accepted=_get(d, cls, "accepted", None),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class BeginAnswer:
    """`begin`'s answer: whether the update is open on the path the trainer asked for."""

    one_copy: bool
    """True: the trainer writes into the shared parameters (the one-copy path) this update."""
    why: str | None = None
    """Why a one-copy update was refused (then nothing was opened); None otherwise."""
    replays: bool = False
    """True: this engine's previous update was opened by the same trainer (the `owner` of this
    `begin`), so its receivers may still hold the views of that trainer's buckets, and a bucket
    announced as "same" can be replayed. False (another trainer's update came between, or the
    engine is new): the trainer describes every bucket in full this update."""

    def to_dict(self) -> dict[str, Any]:
        out = _without_none({"one_copy": self.one_copy, "why": self.why})
        return {**out, "replays": True} if self.replays else out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BeginAnswer:
        return cls(
            one_copy=bool(_get(d, cls, "one_copy")),
            why=_get(d, cls, "why", None),
            replays=bool(_get(d, cls, "replays", False)),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class ShareAnswer:
    """`share_params`'s answer: where the engine's parameters are shared, or why they are not."""

    shared: dict[str, Any] | list[dict[str, Any]] | None
    """The shared segment's description (one per worker at TP > 1), or None when not shared."""
    why: str | None = None
    """Why the parameters are not shared; None when they are."""
    retry: bool = False
    """Whether asking again after a later sync may succeed."""

    def to_dict(self) -> dict[str, Any]:
        return {"shared": self.shared, "why": self.why, "retry": self.retry}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShareAnswer:
        return cls(
            shared=_get(d, cls, "shared"),
            why=_get(d, cls, "why", None),
            retry=bool(_get(d, cls, "retry", False)),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LoadReport:
    """`load_bucket`'s answer: one bucket loaded."""

    num_tensors: int
    """How many tensors the bucket held."""
    nbytes: int
    """How many bytes of the buffer the bucket used."""
    seconds: float
    """How long the engine took to load it."""
    released: dict[str, Any] | None = None
    """What the sender's transport waits for before it writes the bucket's slot again (a
    CUDA event's handle), or None: the engine's reads of the bucket are done."""
    loader_tensors: int | None = None
    """How many of its tensors were handed to the engine's loader (the others were copied
    where the loader put them before: weightsync/engine/loading.py); None: not counted."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_tensors": self.num_tensors,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
        }
        if self.released is not None:
            out["released"] = dict(self.released)
        if self.loader_tensors is not None:
            out["loader_tensors"] = self.loader_tensors
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoadReport:
        released = _get(d, cls, "released", None)
        loader_tensors = _get(d, cls, "loader_tensors", None)
        return cls(
            num_tensors=int(_get(d, cls, "num_tensors")),
            nbytes=int(_get(d, cls, "nbytes")),
            seconds=float(_get(d, cls, "seconds")),
            released=None if released is None else dict(released),
            loader_tensors=None if loader_tensors is None else int(loader_tensors),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class EndReport:
    """`end`'s answer: the update is complete and the engine serves `weight_version`."""

    weight_version: str
    """The version tag the engine serves now."""
    end_s: float | None = None
    """Seconds `end` took (post-processing, cache reset)."""
    session_s: float | None = None
    """Seconds from `begin` to the end of `end`."""
    cache_flushed: bool | None = None
    """Whether the engine's prefix cache was reset."""
    param_of: dict[str, list[str]] | None = None
    """Trainer tensor -> engine parameters, from an engine that learns it while loading."""
    placements: list[dict[str, Any]] | None = None
    """Per tensor-parallel worker, which elements of each tensor it holds
    (weightsync/wire/placement.py); None where every worker holds all."""
    probe: dict[str, Any] | None = None
    """With a probe asked for: how close the engine's scores came (`wire.probe.ProbeReport`'s
    `to_dict()`); an update whose probe failed raises instead of ending."""
    switched_at: float | None = None
    """A staged update (`begin(..., staged=True)`): the wall-clock time (`time.time()`, seconds)
    at which the engine's new weights were in place, its generation still held."""
    switch_at: float | None = None
    """A staged update whose sender named the instant every engine switches at
    (`SyncOptions.switch_lead_s`): that instant; the engine served on until it."""
    pause_s: float | None = None
    """A staged update: how long the engine held generation to switch to the staged weights
    (its only pause of the update)."""
    pause_parts: dict[str, float] | None = None
    """A staged update: `pause_s` in its parts, seconds each, in order: "hold" (until the
    engine stopped generating), "cache" (its prefix cache reset), "switch" (the parameters
    written from the staged copy, every worker), "version" (the tag set), "resume"."""

    def to_dict(self) -> dict[str, Any]:
        return _without_none(
            {
                "weight_version": self.weight_version,
                "end_s": self.end_s,
                "session_s": self.session_s,
                "cache_flushed": self.cache_flushed,
                "param_of": None if self.param_of is None else _param_of(self.param_of),
                "placements": self.placements,
                "probe": self.probe,
                "switched_at": self.switched_at,
                "switch_at": self.switch_at,
                "pause_s": self.pause_s,
                "pause_parts": self.pause_parts,
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EndReport:
        param_of = _get(d, cls, "param_of", None)
        return cls(
            weight_version=_get(d, cls, "weight_version"),
            end_s=_get(d, cls, "end_s", None),
            session_s=_get(d, cls, "session_s", None),
            cache_flushed=_get(d, cls, "cache_flushed", None),
            param_of=None if param_of is None else _param_of(param_of),
            placements=_get(d, cls, "placements", None),
            probe=_get(d, cls, "probe", None),
            switched_at=_get(d, cls, "switched_at", None),
            switch_at=_get(d, cls, "switch_at", None),
            pause_s=_get(d, cls, "pause_s", None),
            pause_parts=_get(d, cls, "pause_parts", None),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class StageReport:
    """`stage`'s answer: what an open update holds, before the engine adopts it, for
    verification (stage, verify, then `end` commits or `abort` rolls back)."""

    fingerprints: list[dict[str, list[int]]]
    """Per worker, {parameter: fingerprint} of the parameters trainer tensors land in,
    computed in the engine process (weightsync/wire/fingerprint.py)."""
    placements: list[dict[str, Any]] | None = None
    """Per worker, where its loader put the elements of each tensor (weightsync/wire/placement.py);
    None from a receiver that reports none."""
    param_of: dict[str, list[str]] | None = None
    """Trainer tensor -> engine parameters, from an engine that learns it while loading."""
    same: bool = False
    """Every worker's fingerprints digest to what `stage`'s `expect` said
    (`fingerprint.prints_digest`): then `fingerprints` is empty and `placements` and
    `param_of` are left out (the trainer's own are those the digests were made from)."""

    def to_dict(self) -> dict[str, Any]:
        return _without_none(
            {
                "fingerprints": self.fingerprints,
                "placements": self.placements,
                "param_of": None if self.param_of is None else _param_of(self.param_of),
                "same": self.same or None,
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageReport:
        param_of = _get(d, cls, "param_of", None)
        return cls(
            fingerprints=list(_get(d, cls, "fingerprints")),
            placements=_get(d, cls, "placements", None),
            param_of=None if param_of is None else _param_of(param_of),
            same=bool(_get(d, cls, "same", False)),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class SettleReport:
    """`settle`'s answer: background work after an update has finished."""

    background_s: float | None = None
    """Seconds the background work took; None for an engine that does none."""

    def to_dict(self) -> dict[str, Any]:
        return _without_none({"background_s": self.background_s})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SettleReport:
        return cls(background_s=_get(d, cls, "background_s", None))


Answer = (
    RefitAnswer | BeginAnswer | ShareAnswer | LoadReport | EndReport | SettleReport | StageReport
)

ANSWERS: dict[str, type[Answer]] = {
    "check_refit": RefitAnswer,
    "begin": BeginAnswer,
    "share_params": ShareAnswer,
    "load_bucket": LoadReport,
    "p2p_receive": LoadReport,
    "end": EndReport,
    "revert": EndReport,
    "settle": SettleReport,
    "stage": StageReport,
}
"""`WeightReceiver` method -> the class of its answer (the other methods answer plain data)."""


def from_wire(method: str, reply: Any) -> Any:
    """A receiver's reply to `method` as it arrived, turned into its `ANSWERS` class (a reply
    to a method without one, as it is)."""
    cls = ANSWERS.get(method)
    return reply if cls is None else cls.from_dict(reply)


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSyncReport:
    """One engine's part of a `SyncReport`."""

    path: str
    """How its weights travelled: "buckets" or "one_copy" (the one-copy path)."""
    status: str = "ok"
    """"ok" (a sync that failed raises instead of reporting)."""
    weight_version: str | None = None
    """The version tag the engine serves now, as its `end` reported."""
    load_s: float | None = None
    """Seconds the engine spent loading buckets (the buckets path only)."""
    loader_tensors: int | None = None
    """The buckets path: how many tensors the engine handed to its own loader, summed over
    the buckets (at TP > 1, the first worker's count); the rest were copied where the loader
    put them at an earlier sync. None where the engine did not count."""
    end_s: float | None = None
    """Seconds its `end` took."""
    session_s: float | None = None
    """Seconds from its `begin` to the end of its `end`."""
    cache_flushed: bool | None = None
    """Whether its prefix cache was reset."""
    share_s: float | None = None
    """Seconds it took to share its parameters after this sync (once, for the one-copy path)."""
    probe_gap: float | None = None
    """Where this sync was probed (weightsync/wire/probe.py): the mean absolute log-prob gap
    between the engine's forward and the trainer's, in nats."""
    probe_max_gap: float | None = None
    """The largest gap of one probe token (its decode steps included)."""
    probe_decode_steps: int | None = None
    """Greedy decode steps the probe scored (`Probe.decode` per prompt, fewer where the
    engine and the trainer chose differently; counted in `probe_gap` too)."""
    probe_decode_max_gap: float | None = None
    """The largest gap among them."""
    probe_s: float | None = None
    """Seconds the engine took to score the probe (a staged sync holds generation for them
    too: it is probed just after its switch)."""
    probe_experts: dict[str, Any] | None = None
    """An MoE model's probe: {"experts": routed experts per layer, "reached": [distinct
    experts its tokens reached, per MoE layer]} in the trainer's forward. A fault in an
    expert no probe token reaches cannot move the probe's scores: more or longer prompts
    (`Probe.num_prompts`, `Probe.length`) reach more."""
    switched_at: float | None = None
    """A staged sync: when the engine's new weights were in place (`time.time()`)."""
    switch_at: float | None = None
    """A staged sync into several engines: the instant the trainer named for every engine's
    switch (`SyncOptions.switch_lead_s`, `EndReport.switch_at`)."""
    pause_s: float | None = None
    """A staged sync: how long the engine held generation to switch (its only pause; one that
    is probed also holds a server's new requests from before the switch, while those in
    flight finish, until its probe is scored: `probe_s`)."""
    pause_parts: dict[str, float] | None = None
    """A staged sync: `pause_s` in its parts (`EndReport.pause_parts`)."""

    @classmethod
    def of(
        cls,
        end: EndReport,
        *,
        path: str,
        load_s: float | None = None,
        loader_tensors: int | None = None,
    ) -> EngineSyncReport:
        probe = end.probe or {}
        return cls(
            path=path,
            weight_version=end.weight_version,
            load_s=load_s,
            loader_tensors=loader_tensors,
            end_s=end.end_s,
            session_s=end.session_s,
            cache_flushed=end.cache_flushed,
            probe_gap=probe.get("mean_gap"),
            probe_max_gap=probe.get("max_gap"),
            probe_decode_steps=probe.get("decode_steps"),
            probe_decode_max_gap=probe.get("decode_max_gap") if probe.get("decode_steps") else None,
            probe_s=probe.get("probe_s"),
            probe_experts=probe.get("experts"),
            switched_at=end.switched_at,
            switch_at=end.switch_at,
            pause_s=end.pause_s,
            pause_parts=end.pause_parts,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "path": self.path,
            **_without_none(
                {
                    "weight_version": self.weight_version,
                    "load_s": self.load_s,
                    "loader_tensors": self.loader_tensors,
                    "end_s": self.end_s,
                    "session_s": self.session_s,
                    "cache_flushed": self.cache_flushed,
                    "share_s": self.share_s,
                    "probe_gap": self.probe_gap,
                    "probe_max_gap": self.probe_max_gap,
                    "probe_decode_steps": self.probe_decode_steps,
                    "probe_decode_max_gap": self.probe_decode_max_gap,
                    "probe_s": self.probe_s,
                    "probe_experts": self.probe_experts,
                    "switched_at": self.switched_at,
                    "switch_at": self.switch_at,
                    "pause_s": self.pause_s,
                    "pause_parts": self.pause_parts,
                }
            ),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSyncReport:
        return cls(
            path=_get(d, cls, "path"),
            status=_get(d, cls, "status", "ok"),
            **{
                name: _get(d, cls, name, None)
                for name in (
                    "weight_version",
                    "load_s",
                    "loader_tensors",
                    "end_s",
                    "session_s",
                    "cache_flushed",
                    "share_s",
                    "probe_gap",
                    "probe_max_gap",
                    "probe_decode_steps",
                    "probe_decode_max_gap",
                    "probe_s",
                    "probe_experts",
                    "switched_at",
                    "switch_at",
                    "pause_s",
                    "pause_parts",
                )
            },
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineVerification:
    """One engine's part of a `VerifyReport`: whether it holds the bytes the trainer sent."""

    verified: bool | None
    """True: every parameter checked holds the trainer's bytes. False: some differ
    (`mismatched`), or nothing could be checked (`num_checked` 0). None: `pending`."""
    mismatched: list[str] = field(default_factory=list)
    """The parameters whose bytes differ ("worker <i>: <name>" where workers are compared one
    by one)."""
    num_checked: int = 0
    """How many parameters (or, on the one-copy path, written pieces) were compared."""
    num_workers: int | None = None
    """How many workers were compared one by one (an engine whose workers hold slices); None
    where the engine was compared as a whole."""
    pending: bool = False
    """Not checked yet: the engine's workers hold slices, whose expected fingerprints need the
    tensors again (`TrainerSync` verifies such engines right after the sync)."""
    unchecked: list[str] = field(default_factory=list)
    """Engine parameters some trainer tensor lands in that this check did not compare (where a
    loader does not put a tensor's bytes into its parameter as they are, or puts them where
    weightsync learned no placement): `verified` says nothing of them. "worker <i>: <name>"
    where workers are compared one by one."""
    by_digest: bool = False
    """Compared by digest: the engine's `stage` answered that every worker's fingerprints
    digest to what the trainer expected there (`StageReport.same`), not with each one."""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "verified": self.verified,
            "mismatched": list(self.mismatched),
            "num_checked": self.num_checked,
        }
        if self.num_workers is not None:
            out["num_workers"] = self.num_workers
        if self.pending:
            out["pending"] = True
        if self.unchecked:
            out["unchecked"] = list(self.unchecked)
        if self.by_digest:
            out["by_digest"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineVerification:
        num_workers = _get(d, cls, "num_workers", None)
        return cls(
            verified=_get(d, cls, "verified"),
            mismatched=[str(p) for p in _get(d, cls, "mismatched", [])],
            num_checked=int(_get(d, cls, "num_checked", 0)),
            num_workers=None if num_workers is None else int(num_workers),
            pending=bool(_get(d, cls, "pending", False)),
            unchecked=[str(p) for p in _get(d, cls, "unchecked", [])],
            by_digest=bool(_get(d, cls, "by_digest", False)),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class VerifyReport:
    """What one verification found, engine by engine: `TrainerSync.verify`'s result, and a
    verified sync's `SyncReport.verify`. `report["vllm"].verified` reads one engine's part.

    As plain data (`to_dict`), the keys the wire has always carried: {engine: {"verified",
    "mismatched", "num_checked", ...}, "verify_s"}."""

    engines: dict[str, EngineVerification] = field(default_factory=dict)
    """Engine name -> its part."""
    verify_s: float = 0.0
    """Seconds the verification took."""

    def __getitem__(self, name: str) -> EngineVerification:
        try:
            return self.engines[name]
        except KeyError:
            raise KeyError(
                f"engine {name!r} was not verified; verified: {sorted(self.engines)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self.engines

    @property
    def verified(self) -> bool:
        """Whether every engine was checked and holds the trainer's bytes."""
        return bool(self.engines) and all(e.verified is True for e in self.engines.values())

    @property
    def pending(self) -> list[str]:
        """The engines left pending, sorted."""
        return sorted(n for n, e in self.engines.items() if e.pending)

    def merged(self, other: VerifyReport) -> VerifyReport:
        """This report with `other`'s engines in place of its own of the same name, and both
        verifications' seconds."""
        return VerifyReport(
            engines={**self.engines, **other.engines}, verify_s=self.verify_s + other.verify_s
        )

    def metrics(self, prefix: str = "weightsync/") -> Metrics:
        """This verification as one flat dict, for a metrics logger (`wandb.log(...)`); every
        value a plain int or float. Keys, each after `prefix`:

        - `verify_s`: seconds the verification took (float).
        - `verified`: 1 if every engine was checked and holds the trainer's bytes, else 0 (as
          `verified`; an engine still `pending` counts as not verified).
        - per engine, `<engine>/verified`: 1 or 0 (pending: 0); `<engine>/num_checked`: how many
          parameters (one-copy path: written pieces) were compared; `<engine>/num_mismatched`:
          how many differed (their names stay in `engines[name].mismatched`);
          `<engine>/num_unchecked`: how many parameters a tensor lands in were not compared
          (names in `engines[name].unchecked`).

        Seconds are not kept per engine: engines are checked together. To log `sync.verify()`
        beside a sync's metrics, give it a prefix of its own (`metrics("weightsync/check/")`)."""
        out: Metrics = {
            f"{prefix}verify_s": float(self.verify_s),
            f"{prefix}verified": int(self.verified),
        }
        for name, engine in self.engines.items():
            out[f"{prefix}{name}/verified"] = int(engine.verified is True)
            out[f"{prefix}{name}/num_checked"] = int(engine.num_checked)
            out[f"{prefix}{name}/num_mismatched"] = len(engine.mismatched)
            out[f"{prefix}{name}/num_unchecked"] = len(engine.unchecked)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            **{n: e.to_dict() for n, e in self.engines.items()},
            "verify_s": self.verify_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VerifyReport:
        verify_s = float(_get(d, cls, "verify_s"))
        return cls(
            engines={
                str(n): EngineVerification.from_dict(e) for n, e in d.items() if n != "verify_s"
            },
            verify_s=verify_s,
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class SyncReport:
    """What one sync did: `WeightSender.sync`'s result, and `TrainerSync.sync`'s on rank 0.
    `to_dict()` is the same as plain data (what a trainer actor returns to its driver, across
    environments); `from_dict()` reads it back."""

    version: str
    """The version tag the engines serve now."""
    path: str
    """"buckets", "one_copy" (the one-copy path), "p2p" (the point-to-point path) or "mixed"
    (engines took different paths)."""
    nbytes: int
    """Bytes of one copy of the model's weights."""
    num_buckets: int
    """Buckets sent (0 on the one-copy path)."""
    sync_s: float
    """Seconds the sync took, verification excluded."""
    engines: dict[str, EngineSyncReport] = field(default_factory=dict)
    """Engine name -> its part."""
    phases_s: dict[str, Any] | None = None
    """The one-copy path (a mixed sync's one-copy part): seconds of "begin", "write", "end",
    and each rank's "rank_write"; the point-to-point path: "begin", "send", "end" and each
    rank's "rank_send"."""
    bytes_written: int | None = None
    """The one-copy and point-to-point paths (a mixed sync's part): bytes the trainer's ranks
    wrote or sent, into all engines' workers."""
    rank_bytes: list[int] | None = None
    """The point-to-point path: bytes each trainer rank sent (index: rank), padding left out."""
    verify: VerifyReport | None = None
    """With verify: what each engine holds, compared with what was sent."""
    dropped: dict[str, str] | None = None
    """Engines left out of this sync because their process died during an earlier one (engine
    -> what was seen); None when none was."""

    @property
    def gbps(self) -> float:
        """Gigabytes of the model per second of sync."""
        return self.nbytes / self.sync_s / 1e9 if self.sync_s > 0 else 0.0

    @property
    def switch_skew_s(self) -> float | None:
        """A staged sync (`SyncOptions.staged`): seconds between the first and the last engine
        having its new weights in place (their `switched_at`, one host's clock); None when no
        engine staged."""
        times = [e.switched_at for e in self.engines.values() if e.switched_at is not None]
        return max(times) - min(times) if times else None

    def metrics(self, prefix: str = "weightsync/") -> Metrics:
        """This sync as one flat dict, for a metrics logger (`wandb.log(report.metrics())`, or
        a TensorBoard writer's `add_scalar` for each number); values are plain floats, ints and
        two strings, nothing nested. Keys, each after `prefix`; a key whose field is unknown
        (None) for this sync is left out rather than logged as 0:

        - `version` (str): the version tag the engines serve now.
        - `path` (str): "buckets", "one_copy", "p2p" or "mixed" (engines took different
          paths).
        - `sync_s`: seconds the sync took, from the first `begin` to the last `end` (a mixed
          sync: both paths' seconds summed); excludes verification, and sharing parameters
          after a sync by buckets (`<engine>/share_s`).
        - `gbps`: gigabytes (1e9 bytes) of one copy of the model per second of sync:
          `nbytes / sync_s / 1e9`, 0.0 when `sync_s` is 0 (as `gbps`).
        - `nbytes`: bytes of one copy of the model's weights (not times the engines).
        - `num_buckets`: buckets sent (0 on the one-copy path).
        - `bytes_written` (the one-copy or point-to-point path, or a mixed sync's part): bytes
          the trainer's ranks wrote or sent, into all engines' workers together;
          `rank0_bytes` (point-to-point): the bytes trainer rank 0 sent.
        - `phase_<name>_s` (the same): seconds of each one-copy phase, `phase_begin_s`,
          `phase_write_s`, `phase_end_s`; `phase_rank_write_max_s`: the slowest rank's seconds
          writing its shards (the one the write phase waits for).
        - per engine: `<engine>/one_copy`: 1 if its weights took the one-copy path, 0 for
          buckets; `<engine>/load_s` (buckets): seconds it spent loading buckets, summed over
          them, as the engine measured; `<engine>/loader_tensors` (buckets): tensors it handed
          to its own loader (the rest were copied where that loader put them at an earlier
          sync; at TP > 1 the first worker's count); `<engine>/end_s`: seconds its `end` took;
          `<engine>/session_s`: seconds from its `begin` to the end of its `end`;
          `<engine>/cache_flushed`: 1 if its prefix cache was reset, else 0;
          `<engine>/share_s`: seconds it took to share its parameters after this sync, outside
          `sync_s` (once: the sync by buckets before its first one-copy sync);
          `<engine>/probe_gap`, `<engine>/probe_max_gap` (a probed sync, `SyncOptions.probe`):
          the mean and the largest absolute log-prob gap, in nats, between its forward and the
          trainer's; `<engine>/probe_decode_max_gap`: the largest among the probe's decode
          steps; `<engine>/pause_s` (a staged sync, `SyncOptions.staged`): seconds it held
          generation to switch to the staged weights.
        - `switch_skew_s` (a staged sync): seconds between the first and the last engine having
          its new weights in place.
        - with verify, `VerifyReport.metrics` under the same prefix: `verify_s` (all engines
          together, not per engine), `verified`, and per engine `<engine>/verified`,
          `<engine>/num_checked`, `<engine>/num_mismatched`, `<engine>/num_unchecked`.
        - `num_dropped`, only when engines were left out because they died (names in `dropped`).

        Left out: each engine's `weight_version` (it is `version`: a sync that fails raises)
        and `status` (always "ok"), and the names of mismatched parameters. A TensorBoard
        scalar takes numbers only: skip the two strings there."""
        out: Metrics = {
            f"{prefix}version": str(self.version),
            f"{prefix}path": str(self.path),
            f"{prefix}sync_s": float(self.sync_s),
            f"{prefix}gbps": float(self.gbps),
            f"{prefix}nbytes": int(self.nbytes),
            f"{prefix}num_buckets": int(self.num_buckets),
        }
        if self.bytes_written is not None:
            out[f"{prefix}bytes_written"] = int(self.bytes_written)
        if self.rank_bytes:
            out[f"{prefix}rank0_bytes"] = int(self.rank_bytes[0])
        for phase, seconds in (self.phases_s or {}).items():
            if isinstance(seconds, list | tuple):  # one per rank
                _put_seconds(out, f"{prefix}phase_{phase}_max_s", max(seconds, default=None))
            else:
                _put_seconds(out, f"{prefix}phase_{phase}_s", seconds)
        for name, engine in self.engines.items():
            out[f"{prefix}{name}/one_copy"] = int(engine.path == "one_copy")
            _put_seconds(out, f"{prefix}{name}/load_s", engine.load_s)
            if engine.loader_tensors is not None:
                out[f"{prefix}{name}/loader_tensors"] = int(engine.loader_tensors)
            _put_seconds(out, f"{prefix}{name}/end_s", engine.end_s)
            _put_seconds(out, f"{prefix}{name}/session_s", engine.session_s)
            if engine.cache_flushed is not None:
                out[f"{prefix}{name}/cache_flushed"] = int(engine.cache_flushed)
            _put_seconds(out, f"{prefix}{name}/share_s", engine.share_s)
            _put_seconds(out, f"{prefix}{name}/pause_s", engine.pause_s)
            _put_seconds(out, f"{prefix}{name}/probe_gap", engine.probe_gap)
            _put_seconds(out, f"{prefix}{name}/probe_max_gap", engine.probe_max_gap)
            _put_seconds(out, f"{prefix}{name}/probe_decode_max_gap", engine.probe_decode_max_gap)
        if self.verify is not None:
            out.update(self.verify.metrics(prefix))
        if self.dropped:
            out[f"{prefix}num_dropped"] = len(self.dropped)
        _put_seconds(out, f"{prefix}switch_skew_s", self.switch_skew_s)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "path": self.path,
            "nbytes": self.nbytes,
            "num_buckets": self.num_buckets,
            "sync_s": self.sync_s,
            "gbps": self.gbps,
            "engines": {n: e.to_dict() for n, e in self.engines.items()},
            **_without_none(
                {
                    "phases_s": self.phases_s,
                    "bytes_written": self.bytes_written,
                    "rank_bytes": self.rank_bytes,
                    "verify": None if self.verify is None else self.verify.to_dict(),
                    "dropped": self.dropped,
                }
            ),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SyncReport:
        engines = _get(d, cls, "engines", {})
        verify = _get(d, cls, "verify", None)
        return cls(
            version=_get(d, cls, "version"),
            path=_get(d, cls, "path"),
            nbytes=int(_get(d, cls, "nbytes")),
            num_buckets=int(_get(d, cls, "num_buckets")),
            sync_s=float(_get(d, cls, "sync_s")),
            engines={n: EngineSyncReport.from_dict(e) for n, e in engines.items()},
            phases_s=_get(d, cls, "phases_s", None),
            bytes_written=_get(d, cls, "bytes_written", None),
            rank_bytes=_get(d, cls, "rank_bytes", None),
            verify=None if verify is None else VerifyReport.from_dict(verify),
            dropped=_get(d, cls, "dropped", None),
        )


def known_maps(
    placements: list[dict[str, Any]] | None, param_of: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """What a sender holds of an engine's placements and tensor -> parameter map, as
    `end(known=...)` takes it: the size of each worker's placements, and of the map. Both
    only grow (a tensor's is learned once, on first sight, and never changes:
    weightsync/engine/replica.py `learn_placements`), so equal sizes mean equal maps."""
    known: dict[str, Any] = {}
    if placements is not None:
        known["placements"] = [len(p or {}) for p in placements]
    if param_of is not None:
        known["param_of"] = len(param_of)
    return known


def without_known(report: EndReport, known: dict[str, Any]) -> EndReport:
    """`report` without the placements and the tensor -> parameter map the sender already
    holds whole (at 200k tensors each is megabytes on the wire every sync, and a map the
    sender takes anew is worked over again)."""
    placements = report.placements
    if placements is not None and known.get("placements") == [len(p or {}) for p in placements]:
        report = replace(report, placements=None)
    if report.param_of is not None and known.get("param_of") == len(report.param_of):
        report = replace(report, param_of=None)
    return report
