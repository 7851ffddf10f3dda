"""`TrainerSync`: the trainer side of weightsync, for any FSDP2 / DTensor training loop.

One `TrainerSync` per trainer rank, built from the framework's own model after its process group
is up. Every method is called on every rank at once (gathering a DTensor is a collective); only
rank 0 talks to engines, the other ranks write their own shards where the path allows it:

    sync = TrainerSync(model, options=SyncOptions(transport="shm"))
    sync.connect({"vllm": engine})           # refit check: nothing is written before it passes
    for step in ...:
        train(...)
        report = sync.sync(f"step-{step}")   # begin, bytes, end on every engine
        if report is not None:               # rank 0: a SyncReport
            log(report.sync_s, report.engines["vllm"].weight_version)
    sync.close()

Paths, chosen per engine and per sync: buckets (every transport; with several ranks each rank
writes its own shards into the shared bucket with `shm`, or sends them to rank 0 in one gather
per bucket with the others) and, with `shm` or `cuda_ipc` from the
second sync on, the one-copy path (weightsync/trainer/one_copy/path.py: ranks write straight into the
engine's parameters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from weightsync.trainer.endpoint import Endpoint, RayEndpoint
from weightsync.trainer.one_copy.path import OneCopyPath
from weightsync.trainer.p2p_path import PointToPointPath, unsendable
from weightsync.trainer.probe import Probe, ProbeScorer
from weightsync.trainer.sender import DEFAULT_TIMEOUT_S, WeightSender
from weightsync.trainer.shard_writes import BucketGatherWriter, BucketShardWriter
from weightsync.trainer.source import DTensorV2Source, Layout
from weightsync.trainer.sync_group import SyncGroup
from weightsync.trainer.verify import SentTable
from weightsync.wire.bucket import DEFAULT_BUCKET_BYTES
from weightsync.wire.fingerprint import FingerprintBatch
from weightsync.wire.placement import WorkerPrints, sliced
from weightsync.wire.protocol import EndReport, RefitAnswer, SyncReport, VerifyReport
from weightsync.wire.specs import dtype_from_str, specs_to_dicts

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn

    from weightsync.transports import SenderTransport

logger = logging.getLogger(__name__)

Transport = Literal["shm", "cuda_ipc", "gloo", "nccl"]
ONE_COPY_TRANSPORTS = ("shm", "cuda_ipc")  # engines on this host: ranks write into them
# `TrainerSync.verify` hashes the tensors it gathered once this many bytes of them are queued
# (held meanwhile, so no gather reuses their memory), not one pass per tensor.
VERIFY_HELD_BYTES = 256 << 20
TRANSPORTS: tuple[str, ...] = get_args(Transport)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncOptions:
    """How `TrainerSync` moves weights. Checked when made: a bad value raises ValueError."""

    transport: Transport = "shm"
    """"shm": CPU shared memory, engines on this host. "cuda_ipc": GPU memory by IPC handle,
    engines on this host. "gloo" / "nccl": a broadcast group of rank 0 and every engine
    process, for engines on other hosts (`collective_host` is the address they connect to)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Largest bucket; two buckets are in flight at once (the trainer fills one while the
    engines load the other)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline of every engine call and every collective of one sync."""
    connect_timeout_s: float = 900.0
    """Deadline of `connect`, which also waits for engines that are still starting."""
    verify: bool = True
    """Default of `sync(verify=...)`: compare what each engine holds with what was sent, before
    it adopts the update (on by default; False opts out). Engines that cannot be verified (stock
    engines) are refused at `connect` unless it is False."""
    allow_unchecked: bool = False
    """A verified sync by buckets fails, before any engine commits, when an engine holds a
    parameter that could not be compared (its loader does not copy the tensors verbatim),
    naming it; True lets it pass, listed in `report.verify[engine].unchecked`."""
    keep_previous: bool = False
    """Engines that can (SGLang, vLLM) keep a copy of their weights during an update and put
    it back when the update fails; engines that cannot are logged and go on without."""
    one_copy: bool | None = None
    """The one-copy path from the second sync on. None: wherever the transport allows it
    (`shm`: into CPU engines' parameters; `cuda_ipc`: into GPU engines' parameters by IPC
    handle); True: required (a transport that cannot is refused); False: buckets only."""
    shard_writes: bool = True
    """With several ranks, the ranks move their own dim-0 shards in bulk: with `shm` each rank
    writes them into the shared buckets (no gather); with `cuda_ipc`, `gloo` and `nccl` one
    gather per bucket brings every rank's shards of it to rank 0 (tensor-parallel and
    adapter-converted tensors are still gathered one at a time). False: rank 0 sends full
    tensors, each gathered on its own (`full_tensor()`: one all-gather per tensor)."""
    sync_dtype: str | None = None
    """Send floating-point tensors in this dtype ("bfloat16", ...); None: the training dtype."""
    collective_host: str = "127.0.0.1"
    """`gloo` / `nccl`: the address of rank 0 that engine processes connect to."""
    accept_unkept: Mapping[str, str] | None = None
    """Forms an engine derives after loading that a sync cannot keep in step, accepted anyway:
    {kind: why it is acceptable} (the kinds a refusal at `connect` names, e.g. "sinks_copy",
    "mla_up_projections": backends/vllm/unkept.py and derived.py, backends/sglang/derived.py).
    The engine then computes with those tensors as they were when it
    started, whatever the syncs write; `connect` logs each with its reason, and its answer
    lists them. None: each such form is refused at `connect`, naming it."""
    check_finite: bool = False
    """Before each sync every rank reads its own shards once: a NaN or an infinity (or a value
    the sending dtype cannot hold) refuses the sync, naming the tensors, before anything is
    written."""
    point_to_point: bool = False
    """From the second sync on, every rank sends the pieces of its own shards straight to the
    engine workers that keep them (weightsync/transports/p2p.py, gloo; nccl with transport
    "nccl" or "cuda_ipc"), as a transfer plan made once says: no byte passes through rank 0
    but its own. The first sync goes by `transport` and shows where each worker's loader puts
    each tensor. Needs tensors sent as the ranks hold them (no `sync_dtype` conversion, no
    adapter) and engines that can (vLLM; refused at `connect` otherwise); the one-copy path
    is off. The group's store listens on `collective_host`."""
    probe: Probe | None = None
    """An end-to-end check independent of the engines' loaders (weightsync/trainer/probe.py):
    on each engine's first sync after `connect` (and every `probe.every`-th), the engine
    scores fixed tokens with its own forward on the staged weights, the trainer with its
    model; a mean gap above `probe.bound` (or one token's above `probe.max_bound`) fails the
    sync before the engine commits. Engines that
    cannot score one are refused at `connect`. A staged sync that probes scores the weights
    just switched in, generation still held (a server's clients held, those in flight let
    finish first), and on a failure switches back to the previous weights (with
    `keep_previous`; without, the engine refuses to serve until a sync completes) before any
    client is answered: its hold lasts the probe too (docs/staged.md)."""
    staged: bool = False
    """Engines keep serving their current weights while each sync loads into a second copy of
    their parameters (weightsync/engine/staging.py), which is verified (with `verify`) and then
    switched in on every engine at once, each in one short pause (`SyncReport.engines[name]
    .pause_s`, `SyncReport.switch_skew_s`); a sync that fails before the switch leaves every
    engine serving what it served. Costs one more copy of each engine's parameters. Goes by
    buckets (the one-copy and point-to-point paths are off); engines that cannot stage (stock
    engines, some SGLang models: docs/staged.md) are refused at `connect`."""
    switch_lead_s: float = 0.0
    """A staged sync (and a revert) into more than one engine: the trainer names one instant,
    this long after it sends their `end`s, at which every engine switches (each serves on until
    then; one whose `end` arrives later switches at once), so their switches are apart by how
    long each takes from that instant to its copy, not by when each `end` arrived
    (`SyncReport.switch_skew_s`; the engines report the instant as `switch_at`). Engines on
    several hosts need their clocks in step (NTP). 0 (the default): each engine switches when
    its `end` arrives. docs/staged.md gives what it changed on one host."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"SyncOptions.transport={self.transport!r}: expected one of {list(TRANSPORTS)}"
            )
        for name in ("bucket_bytes", "timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SyncOptions.{name}={value!r}: must be a positive number")
        lead = self.switch_lead_s
        if not isinstance(lead, int | float) or isinstance(lead, bool) or not 0 <= lead <= 60:
            raise ValueError(
                f"SyncOptions.switch_lead_s={lead!r}: must be a number of seconds from 0 (each "
                f"engine switches when its end arrives) to 60"
            )
        if not isinstance(self.bucket_bytes, int):
            raise ValueError(f"SyncOptions.bucket_bytes={self.bucket_bytes!r}: must be an int")
        if self.one_copy and self.transport not in ONE_COPY_TRANSPORTS:
            raise ValueError(
                f"SyncOptions.one_copy=True with transport={self.transport!r}: "
                f"the one-copy path needs transport='shm' or 'cuda_ipc' (engines "
                f"on this host); set one_copy=None or "
                f"False for {self.transport!r}"
            )
        if self.point_to_point and self.one_copy:
            raise ValueError(
                "SyncOptions.point_to_point=True with one_copy=True: the two paths exclude each "
                "other; set one_copy=None (off with point_to_point) or point_to_point=False"
            )
        if self.staged and (self.one_copy or self.point_to_point):
            given = "one_copy=True" if self.one_copy else "point_to_point=True"
            raise ValueError(
                f"SyncOptions.staged=True with {given}: a staged sync goes by buckets into a copy "
                f"the engine does not compute with, so it has no one-copy or point-to-point path; "
                f"leave {given.split('=')[0]} out or staged=False"
            )
        if self.probe is not None and not isinstance(self.probe, Probe):
            raise ValueError(
                f"SyncOptions.probe={self.probe!r:.100}: expected a weightsync.Probe (or None)"
            )
        accept = self.accept_unkept
        if accept is not None and not (
            isinstance(accept, Mapping)
            and all(
                isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in accept.items()
            )
        ):
            raise ValueError(
                f"SyncOptions.accept_unkept={accept!r:.200}: expected {{kind: reason}}, each "
                f"reason a non-empty string saying why serving that form stale is acceptable"
            )
        if self.sync_dtype is not None:
            try:
                dtype_from_str(self.sync_dtype)
            except (ValueError, KeyError, AttributeError):
                raise ValueError(
                    f"SyncOptions.sync_dtype={self.sync_dtype!r}: not a torch "
                    f"dtype name (e.g. 'bfloat16', 'float32')"
                ) from None


class _RankLog(logging.LoggerAdapter):
    def __init__(self, logger: logging.Logger, rank: int) -> None:
        super().__init__(logger, {"rank": rank})
        self.rank = rank

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.rank}] {msg}", kwargs


def _gpu_of(model: nn.Module) -> str | None:
    """The UUID of the GPU the model's parameters are on (None: not on a GPU)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    from weightsync.transports.cuda_ipc import device_uuid

    return device_uuid(device)


class TrainerSync:
    """Keeps engines in step with one trainer rank's model. Every method: all ranks, together.

    `model`: the framework's FSDP2 / DTensor model (or any `nn.Module`: unsharded parameters
    are sent from rank 0); names reach the engines through `model.state_dict_adapter.to_hf`
    when it has one. `group`: the process group whose ranks hold the model (default: the
    world); construct on every process of the default group at once. Rank 0 talks to the
    engines and answers with typed results (`SyncReport`, `VerifyReport`); the other ranks take
    part and answer None."""

    def __init__(
        self,
        model: nn.Module,
        *,
        options: SyncOptions | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.options = options = options or SyncOptions()
        self.group = SyncGroup(group, timeout_s=options.timeout_s)
        self.rank = self.group.rank
        self.log = _RankLog(logger, self.rank)
        self.source = DTensorV2Source(model, dtype=options.sync_dtype)
        # Even one rank fills buckets from its local tensors, skipping `full_tensor()`'s
        # redistribute per tensor (a bucket with no other rank's bytes gathers nothing), with
        # each bucket's copies made once (`ShardPieces` and the writers' copy lists).
        self.shard_writes = options.shard_writes
        self.one_copy = (
            options.one_copy is not False
            and options.transport in ONE_COPY_TRANSPORTS
            and not options.point_to_point
            and not options.staged
        )
        if options.one_copy is None and not self.one_copy and self.rank == 0:
            why = (
                "point_to_point=True"
                if options.point_to_point
                else "staged=True"
                if options.staged
                else f"transport {options.transport!r} has no one-copy path"
            )
            self.log.info("one_copy off: %s", why)
        writer = BucketShardWriter if options.transport == "shm" else BucketGatherWriter
        self.buckets = writer(self.source, self.group, bucket_bytes=options.bucket_bytes)
        rank_gpus = None
        if self.one_copy and options.transport == "cuda_ipc":  # where each rank's shards are
            rank_gpus = self.group.gather(_gpu_of(model))
        self.one_copy_path = OneCopyPath(
            self.source,
            self.group,
            log=self.log,
            transport=options.transport,
            rank_gpus=rank_gpus,
        )
        self.p2p_path = (
            PointToPointPath(
                self.source,
                self.group,
                log=self.log,
                host=options.collective_host,
                backend="nccl" if options.transport in ("nccl", "cuda_ipc") else "gloo",
                timeout_s=options.timeout_s,
            )
            if options.point_to_point
            else None
        )
        self.sender: WeightSender | None = None
        self.probe = None if options.probe is None else ProbeScorer(options.probe, model)
        self._agreed: Layout = []  # the model's tensors at connect (rank 0)
        self._num_syncs = 0

    def refit_info(self) -> list[dict]:
        """[{name, dtype, shape, nbytes}] in send order: what every sync sends."""
        return specs_to_dicts(self.source.specs())

    def connect(self, engines: Mapping[str, Any]) -> dict[str, RefitAnswer] | None:
        """Register engines {name: engine actor handle, `Endpoint`, or {"actor": handle,
        "dispatch": method} (a framework's own actor holding the engine actor: plain data, for a
        call across environments)} and check refit info with each (rank 0; the other ranks'
        `engines` are ignored). Nothing is written to an engine
        before every check passed. Returns each engine's `RefitAnswer` (`num_params`,
        `num_receivers`, ...) on rank 0, None on the other ranks."""
        if self.rank != 0:
            return None
        opts = self.options
        sender = self.sender
        if sender is None:
            self._agreed = self.source.layout()  # what every later sync is checked against
            sender = self.sender = WeightSender(
                self.source.specs(),
                transport=None,
                capacity_bytes=opts.bucket_bytes,
                timeout_s=opts.timeout_s,
                allow_unchecked=opts.allow_unchecked,
                staged=opts.staged,
                switch_lead_s=opts.switch_lead_s,
            )
        elif engines and opts.transport in ("gloo", "nccl"):
            raise ValueError(
                f"transport {opts.transport!r} forms one group for all engines: "
                f"connect every engine in one connect() call"
            )
        if self.p2p_path is not None and (why := unsendable(self.source, self.rank)):
            raise ValueError(f"point_to_point=True: {why}")
        answers: dict[str, RefitAnswer] = {}
        for name, engine in engines.items():
            endpoint = _endpoint(name, engine)
            answers[name] = sender.add_engine(
                endpoint, timeout_s=opts.connect_timeout_s, accept=opts.accept_unkept
            )
            for form in answers[name].accepted or []:
                self.log.warning("engine %r serves stale, as accepted: %s", name, form)
            if opts.verify and answers[name].unverifiable:
                del sender.engines[name]
                raise ValueError(
                    f"engine {name!r} cannot be verified and this trainer verifies every sync "
                    f"(verify=True, the default): {answers[name].unverifiable}; to sync into it "
                    f"unverified, make the trainer with SyncOptions(verify=False)"
                )
            if self.probe is not None:
                self._check_probe_support(sender, name)
            if self.p2p_path is not None:
                self._refuse_unless(
                    sender,
                    name,
                    "p2p_support",
                    "cannot take the point-to-point path (SyncOptions.point_to_point=True)",
                    "without point_to_point",
                )
            if opts.staged:
                self._refuse_unless(
                    sender,
                    name,
                    "staged_support",
                    "cannot take staged updates (SyncOptions.staged=True)",
                    "without staged",
                )
            if opts.keep_previous:
                self._keep_previous(sender, name)
        if sender.transport is None and answers:
            sender.transport = self._make_transport(sum(a.num_receivers for a in answers.values()))
        return answers

    def _connected(self) -> WeightSender:
        """Rank 0's sender, which `connect` makes."""
        if self.sender is None:
            raise RuntimeError(
                f"rank {self.rank} has no sender: only rank 0 talks to engines, after "
                f"connect({{name: engine}})"
            )
        return self.sender

    def _refuse_unless(
        self, sender: WeightSender, name: str, method: str, cannot: str, instead: str, *args: Any
    ) -> None:
        """Refuse, at connect, an engine whose `method` ("probe_support", "p2p_support") says
        why it cannot do what this trainer asks (`cannot`); `instead`: the trainer that would
        take it."""
        try:
            why = sender.call(name, method, *args)
        except (AttributeError, RuntimeError) as exc:
            why = f"it answers no {method} ({str(exc).splitlines()[0][:200]})"
        if why:
            del sender.engines[name]
            raise ValueError(
                f"engine {name!r} {cannot}: {why}; connect it from a TrainerSync {instead}"
            )

    def _check_probe_support(self, sender: WeightSender, name: str) -> None:
        """Refuse, at connect, an engine that cannot score this trainer's probe (its decode
        steps included)."""
        if self.probe is None:  # never, when called: narrowed for the type checker
            return
        decode = self.probe.probe.decode_steps > 0
        self._refuse_unless(
            sender,
            name,
            "probe_support",
            "cannot score this trainer's probe (SyncOptions.probe)",
            "without a probe" + (", or with Probe(decode=0)" if decode else ""),
            *((True,) if decode else ()),
        )
        self.probe.probed.discard(name)  # connected anew: probed on its next sync

    def _keep_previous(self, sender: WeightSender, name: str) -> None:
        try:
            sender.call(name, "set_keep_previous", True)
        except (AttributeError, RuntimeError) as exc:
            self.log.info(
                "keep_previous off for engine %r: it cannot keep its previous weights (%s)",
                name,
                str(exc).splitlines()[0][:200],
            )

    def _make_transport(self, num_receivers: int) -> SenderTransport:
        from weightsync.transports import make_sender

        return make_sender(
            self.options.transport,
            num_receivers=num_receivers,
            host=self.options.collective_host,
            timeout_s=self.options.timeout_s,
        )

    def sync(
        self,
        version: str | None = None,
        *,
        verify: bool | None = None,
        engines: list[str] | None = None,
    ) -> SyncReport | None:
        """Deliver the model's current weights to `engines` (default: all connected) as
        `version` (default "v<n>"). Rank 0 returns the `SyncReport` (`report.path`,
        `report.engines[name].weight_version`, with verify `report.verify[name].verified`;
        `report.to_dict()` is the same as plain data, for a Ray call between envs); the other
        ranks return None. Raises on rank 0's error on every rank; a failed engine keeps its
        previous version. After a sync that failed on any rank, the next one first rebuilds
        the ranks' sync group, so the same trainer syncs again."""
        if self.group.recover():
            self.log.warning("the last sync failed on some rank: the ranks' sync group was rebuilt")
        try:
            with self.source.held():  # the model's tensors looked up once for the sync
                return self._sync(version, verify=verify, engines=engines)
        except BaseException:
            self.group.failed = True  # the next sync rebuilds the group on every rank
            raise

    def _sync(
        self, version: str | None, *, verify: bool | None, engines: list[str] | None
    ) -> SyncReport | None:
        self._num_syncs += 1
        version = version or f"v{self._num_syncs}"
        verify = self.options.verify if verify is None else verify
        nonfinite: list[str] = []
        if self.options.check_finite:  # every rank its own shards, before anything is written
            found = self.group.gather(self.source.nonfinite())
            nonfinite = sorted({name for names in found or [] for name in names})
        plan = self.group.broadcast(
            self._plan(engines, verify, nonfinite) if self.rank == 0 else None
        )
        if "error" in plan:
            raise ValueError(plan["error"])
        buckets = list(plan["buckets"])
        probe = None
        if plan.get("probe") and self.probe is not None:  # every rank runs the forward
            request = self.probe.request()
            probe = {name: request for name in plan["probe"]}
        p2p_report = None
        if plan.get("p2p") and self.p2p_path is not None:
            p2p_report, fallback = self._sync_p2p(version, plan["p2p"], verify=verify, probe=probe)
            buckets += fallback
        one_copy_report = None
        if plan["one_copy"]:
            one_copy_report, fallback = self.one_copy_path.sync(
                self.sender, version, plan["one_copy"], verify=verify, probe=probe
            )
            buckets += fallback
        bucket_report = None
        if buckets:
            bucket_report = self._sync_buckets(version, buckets, verify=verify, probe=probe)
            if bucket_report is not None and self.one_copy:
                bucket_report = self.one_copy_path.share(self._connected(), buckets, bucket_report)
            if bucket_report is not None and self.p2p_path is not None:
                self.p2p_path.consider(self._connected(), buckets)
        report = _merge([p2p_report, one_copy_report, bucket_report]) if self.rank == 0 else None
        if self.probe is not None:
            self.probe.probed.update(plan.get("probe") or [])
        if report is not None and plan.get("dropped"):
            report = replace(report, dropped=plan["dropped"])
        if report is None:  # every rank but 0
            return None
        self.log.info(
            "sync %s: %.3f s, %.2f GB/s (%s)", version, report.sync_s, report.gbps, report.path
        )
        return report

    def revert(self, engines: list[str] | None = None) -> dict[str, EndReport] | None:
        """Put back on `engines` (default: all connected), all at once, the weights the last
        sync replaced, and their version tag: after a staged sync with `keep_previous`
        (`SyncOptions(staged=True, keep_previous=True)`: each switch kept what it replaced),
        before the next sync. Each engine reverts in one short pause, as it switched. Rank 0
        returns {engine: `EndReport`} (`weight_version`: the version served again, `pause_s`,
        `switched_at`); the other ranks return None (nothing to gather). Raises, naming the
        engine, where one cannot (its last update was not such a sync, or it failed)."""
        if self.rank != 0:
            return None
        sender = self._connected()
        names = list(sender.engines) if engines is None else list(engines)
        unknown = [n for n in names if n not in sender.engines]
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}; registered: {list(sender.engines)}")
        lead = self.options.switch_lead_s
        at = (time.time() + lead,) if len(names) > 1 and lead > 0 else ()
        calls = [sender.calls.submit(n, "revert", *at) for n in names]
        errors, reports = [], {}
        for call in calls:  # every answer, so one engine's failure does not hide another's
            try:
                reports[call[0]] = sender.calls.wait_all([call])[0]
            except Exception as exc:  # noqa: BLE001 - reported together below
                errors.append(f"{call[0]}: {exc}")
        if errors:
            raise RuntimeError(f"revert failed on {len(errors)} engine(s): {'; '.join(errors)}")
        return reports

    def verify(self, engines: list[str] | None = None) -> VerifyReport | None:
        """Compare each engine's parameters with the model's current weights, without syncing.
        Rank 0 returns the `VerifyReport` (`report[name].verified`, `.mismatched`,
        `.num_checked`); the other ranks return None. A tensor-parallel engine is checked
        worker by worker against the slices it holds."""
        sender = self.sender if self.rank == 0 else None
        names: list[str] = []
        unknown: list[str] = []
        workers: dict[str, WorkerPrints] = {}
        if sender is not None:
            names = list(sender.engines) if engines is None else list(engines)
            unknown = [n for n in names if n not in sender.engines]
            specs = sender.verifier.specs
            for n in names:
                placements = None if n in unknown else sender.engines[n].placements
                # Workers that hold every tensor whole are checked from the tensors'
                # fingerprints alone (`prints_from_sent`); slices need the elements.
                if placements is not None and any(sliced(p, specs) for p in placements):
                    workers[n] = WorkerPrints(placements)
        batch, order = FingerprintBatch(), []
        held: list[torch.Tensor] = []  # queued for hashing: their memory is not reused meanwhile
        held_bytes = 0
        for name, tensor in self.source.tensors():  # every rank takes part in each gather
            if names:
                order.append(name)
                batch.add(tensor)
                held.append(tensor)
                held_bytes += tensor.numel() * tensor.element_size()
                if held_bytes >= VERIFY_HELD_BYTES:  # one hashing pass per this many bytes
                    batch.flush()
                    held, held_bytes = [], 0
                for prints in workers.values():
                    prints.add(name, tensor)
        sent = SentTable(order, batch.read_table())
        del held
        if self.rank != 0:
            return None
        # Refused only now: rank 0 raising before the gathers would leave the others waiting.
        if sender is None or not sender.engines:
            raise ValueError("verify before connect: call connect({name: engine}) first")
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}; registered: {list(sender.engines)}")
        why = sender.unverifiable(names)
        if why:
            raise ValueError(f"verify refused: {why}")
        return sender.verify(
            sent, engines=names, worker_sent={n: w.result() for n, w in workers.items()}
        )

    def close(self) -> None:
        """Free the transport, the mapped segments and the sync group (all ranks)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.one_copy_path.close()
        if self.p2p_path is not None:
            self.p2p_path.close()
        self.buckets.close()
        self.group.close()

    def _plan(
        self, engines: list[str] | None, verify: bool, nonfinite: list[str]
    ) -> dict[str, Any]:
        """Rank 0: which engines take the one-copy path this sync, which take buckets; an
        error, before anything is written, when the sync cannot be made as asked."""
        if self.sender is None or not self.sender.engines:
            return {"error": "sync before connect: call connect({name: engine}) first"}
        dead = self.sender.calls.dead
        names = [n for n in self.sender.engines if n not in dead] if engines is None else engines
        unknown = [n for n in names if n not in self.sender.engines]
        if unknown:
            return {
                "error": f"unknown engine(s) {unknown}; registered: {list(self.sender.engines)}"
            }
        if dead and self.options.transport in ("gloo", "nccl"):
            return {
                "error": f"engine(s) {sorted(dead)} died in an earlier sync, and transport "
                f"{self.options.transport!r} formed one group with every engine: make a new "
                f"TrainerSync and connect the living engines ({dict(dead)})"
            }
        gone = {n: dead[n] for n in names if n in dead}
        if gone:
            return {
                "error": f"engine(s) {sorted(gone)} died in an earlier sync ({gone}); leave them "
                f"out (engines=None syncs the living ones) or connect a new engine"
            }
        if not names:
            return {"error": f"every connected engine died: {dict(dead)}; connect a new engine"}
        changed = _changed_since_connect(self._agreed, self.source.layout())
        if changed:
            return {"error": f"sync refused, nothing was written: {changed}"}
        if nonfinite:
            return {
                "error": f"sync refused, nothing was written: {len(nonfinite)} tensor(s) hold a "
                f"NaN or an infinity (check_finite=True), e.g. {nonfinite[:5]}; check the "
                f"training step (its loss, its learning rate) before syncing"
            }
        why = self.sender.unverifiable(names) if verify else None
        if why:
            return {"error": f"sync(verify=True) refused, nothing was written: {why}"}
        one_copy = [n for n in names if self.one_copy_path.takes(n)]
        p2p = [n for n in names if self.p2p_path is not None and self.p2p_path.takes(n)]
        return {
            "probe": self.probe.due(names, self._num_syncs) if self.probe is not None else [],
            "one_copy": one_copy,
            "p2p": p2p,
            "buckets": [n for n in names if n not in one_copy and n not in p2p],
            "dropped": {n: dead[n] for n in self.sender.engines if n in dead} or None,
        }

    def _sync_buckets(
        self, version: str, names: list[str], *, verify: bool, probe: dict[str, dict] | None
    ) -> SyncReport | None:
        if self.rank != 0:
            if self.shard_writes:
                self.buckets.follow()
            else:
                for _ in self.source.tensors():  # take part in every gather
                    pass
            if verify:
                self._follow_checks()
            return None
        sender = self._connected()
        peers = _RankZeroSteps(self) if verify else None
        try:
            if self.shard_writes:
                report = sender.sync(
                    None,
                    version=version,
                    engines=names,
                    verify=verify,
                    write_bucket=self.buckets.sender_hook(sender.transport),
                    probe=probe,
                    peers=peers,
                )
            else:
                report = sender.sync(
                    self.source.tensors(),
                    version=version,
                    engines=names,
                    verify=verify,
                    probe=probe,
                    peers=peers,
                )
        except BaseException as exc:
            if peers is not None:
                peers.failed(exc)
            raise
        if peers is not None:
            peers.done()
        return report

    def _sync_p2p(
        self, version: str, names: list[str], *, verify: bool, probe: dict[str, dict] | None
    ) -> tuple[SyncReport | None, list[str]]:
        """The point-to-point path (every rank): rank 0's report and the engines that go by
        buckets instead."""
        path = self.p2p_path
        if path is None:  # only called with one: narrowed for the type checker
            raise RuntimeError("point-to-point sync without point_to_point=True")
        if self.rank != 0:
            report, fallback = path.sync(None, version, names, verify=verify)
            if not fallback:  # sent: wait to hear whether rank 0 finished the sync
                self._follow_checks()
            return report, fallback
        # Once the ranks sent, they wait for rank 0's done or error (verified or not), so a
        # failure after the sends reaches every rank before any goes on to other paths.
        peers = _RankZeroSteps(self)
        try:
            report, fallback = path.sync(
                self._connected(), version, names, verify=verify, probe=probe, peers=peers
            )
        except BaseException as exc:
            peers.failed(exc)
            raise
        peers.done()
        return report, fallback

    def _follow_checks(self) -> None:
        """Every rank but 0, after its part of a verified bucket sync: read the tensors again
        while rank 0 checks engines whose placements it learned only now, then raise if rank 0
        failed the sync (`_RankZeroSteps` on rank 0)."""
        while True:
            step = self.group.broadcast(None)
            if "alive" in step:  # rank 0 is between two engine calls
                continue
            if "pending" in step:
                for _ in self.source.tensors():  # take part in every gather
                    pass
            elif "error" in step:
                raise RuntimeError(f"rank 0 failed this sync: {step['error']}")
            else:
                return


def _endpoint(name: str, engine: Any) -> Endpoint:
    """What `connect` was given for engine `name`, as an `Endpoint`."""
    if isinstance(engine, Endpoint):
        return engine
    if isinstance(engine, Mapping):
        extra = sorted(set(engine) - {"actor", "dispatch"})
        if "actor" not in engine or extra:
            raise ValueError(
                f"connect: engine {name!r} given as {sorted(engine)}: a plain form is "
                f'{{"actor": <actor handle>, "dispatch": <method name or None>}}'
            )
        dispatch = engine.get("dispatch")
        if dispatch is not None and not isinstance(dispatch, str):
            raise ValueError(
                f"connect: engine {name!r}: dispatch={dispatch!r} is not a method name"
            )
        return RayEndpoint(engine["actor"], name=name, dispatch=dispatch)
    return RayEndpoint(engine, name=name)


class _RankZeroSteps:
    """Rank 0's side of `TrainerSync._follow_checks` during a verified bucket sync (the
    sender's `SyncPeers`): once every bucket is sent, the other ranks wait for one of
    {"pending": engines} (read the tensors again with rank 0, which computes those engines'
    worker fingerprints before they commit), {"alive": True} (between two of rank 0's engine
    calls: wait again), {"error": ...} (the sync failed on rank 0) or {"done": True}."""

    def __init__(self, sync: TrainerSync) -> None:
        self.sync = sync
        self.waiting = False  # the other ranks are at `_follow_checks`

    def filled(self) -> None:
        self.waiting = True

    def worker_prints(self, engines: list[str]) -> dict[str, list[dict[str, Any]]]:
        sync, sender = self.sync, self.sync._connected()
        self.waiting = False  # until the pass is over, the others are not at a broadcast
        sync.group.broadcast({"pending": engines})
        workers = {n: WorkerPrints(sender.engines[n].placements or []) for n in engines}
        for name, tensor in sync.source.tensors():  # every rank takes part in each gather
            for prints in workers.values():
                prints.add(name, tensor)
        self.waiting = True
        return {n: w.result() for n, w in workers.items()}

    def failed(self, exc: BaseException) -> None:
        if self.waiting:
            self.waiting = False
            self.sync.group.broadcast({"error": _cut(f"{type(exc).__name__}: {exc}")})

    def alive(self) -> None:
        if self.waiting:
            self.sync.group.broadcast({"alive": True})

    def done(self) -> None:
        if self.waiting:
            self.waiting = False
            self.sync.group.broadcast({"done": True})


def _cut(text: str, limit: int = 2000) -> str:
    """`text` within `limit` characters: its start and its end (a remote error's message comes
    after its traceback), what was left out between them counted."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]} ... ({len(text) - limit} characters left out) ... {text[-tail:]}"


def _changed_since_connect(agreed: Layout, now: Layout) -> str | None:
    """What differs between the tensors the engines agreed to at connect and the model's now
    (a tensor added, gone, or of another shape or dtype), or None. Every write, by buckets or
    into shared parameters, is sized by what was agreed."""
    if agreed == now:
        return None
    before, after = dict(agreed), dict(now)
    problems = [f"{n!r} is new" for n in after if n not in before]
    problems += [f"{n!r} is gone" for n in before if n not in after]
    problems += [
        f"{n!r} is {after[n][1]} {after[n][0]}, agreed {was[1]} {was[0]}"
        for n, was in before.items()
        if n in after and after[n] != was
    ]
    return (
        f"the model's tensors changed since connect: {'; '.join(problems[:5])}"
        + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        + "; a changed model needs a new TrainerSync, connected again"
    )


def _merge(reports: list[SyncReport | None]) -> SyncReport:
    """One report for a sync whose engines took different paths (point to point, one copy,
    buckets)."""
    taken = [r for r in reports if r is not None]
    if not taken:
        raise RuntimeError("a sync produced no report: no engine took any path")
    report = taken[-1]
    for other in reversed(taken[:-1]):
        report = _merge_two(other, report)
    return report


def _merge_two(one_copy: SyncReport, buckets: SyncReport) -> SyncReport:
    """One report of two parts: `one_copy` (or point to point), then `buckets`."""
    verify = one_copy.verify
    if buckets.verify is not None:
        verify = buckets.verify if verify is None else verify.merged(buckets.verify)
    return replace(
        buckets,
        path="mixed",
        engines={**one_copy.engines, **buckets.engines},
        sync_s=one_copy.sync_s + buckets.sync_s,
        phases_s=one_copy.phases_s,  # the buckets path has none
        bytes_written=one_copy.bytes_written,
        rank_bytes=one_copy.rank_bytes,
        verify=verify,
    )
