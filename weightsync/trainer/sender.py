"""The sender: streams a model's tensors through buckets into one or more engines.

Runs on the sending rank of the trainer (rank 0); the other ranks only take part in gathering.
One sync, for every engine at once:
  begin(version) -> for each bucket: fill a transport slot, load_bucket(descriptor) -> end(version)
With two slots the trainer gathers and packs bucket i+1 while the engines load bucket i; a slot
is reused only after every engine has finished loading what it held. Any failure aborts the
session on every engine (they keep their previous version tag) and is raised, naming the engine.
Every engine's answer becomes its weightsync/wire/protocol.py class where it arrives
(weightsync/trainer/endpoint.py's `EngineCalls`); what verification compares is weightsync/trainer/verify.py.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from weightsync.trainer.endpoint import Call, Endpoint, EngineCalls, EngineState
from weightsync.trainer.switches import end_all_or_none
from weightsync.trainer.verify import Sent, SentPrints, Verifier, WorkerSent
from weightsync.transports import SenderTransport
from weightsync.wire.bucket import (
    BucketPlan,
    check_stream_end,
    fill_buckets,
    plan_buckets,
    take_bucket,
    tensor_view,
)
from weightsync.wire.fingerprint import Fingerprint, KeptHashes
from weightsync.wire.protocol import (
    BeginAnswer,
    EndReport,
    EngineSyncReport,
    LoadReport,
    RefitAnswer,
    SyncReport,
    VerifyReport,
    from_wire,
    known_maps,
)
from weightsync.wire.specs import BucketDescriptor, TensorSpec, specs_to_dicts

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class SyncPeers(Protocol):
    """What a verified bucket sync needs from the trainer's other ranks (`TrainerSync` on rank 0),
    beyond the tensors it streams."""

    def filled(self) -> None:
        """Every bucket was sent: the other ranks have done their part of the stream."""

    def worker_prints(self, engines: list[str]) -> WorkerSent:
        """For `engines`, whose workers hold slices placed as the engines' `stage` answers said
        (`EngineState.placements`): each worker's expected fingerprints, from the tensors
        read again (every rank takes part)."""
        ...

    def alive(self) -> None:
        """Between two engine calls after `filled`: the other ranks, waiting in one collective
        (bounded by the sync's timeout) until the sync ends, hear that it goes on, so their
        wait spans one engine call (each bounded too), not all of them."""


class WeightSender:
    """Plans buckets once from refit info, then runs syncs into registered engines."""

    def __init__(
        self,
        specs: list[TensorSpec],
        *,
        transport: SenderTransport | None,
        capacity_bytes: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        allow_unchecked: bool = False,
        staged: bool = False,
        switch_lead_s: float = 0.0,
    ) -> None:
        """`transport` may be set later (`self.transport = ...`), e.g. once the engines are
        known, as a collective transport needs their number. `allow_unchecked`: a verified
        sync passes with parameters it could not compare (else it fails naming them).
        `staged`: every sync by buckets is a staged update on the engines (`WeightReceiver
        .begin`): they serve on until `end` switches them; with `switch_lead_s` and more than
        one engine, all at one instant that long after their `end`s are sent."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be positive")
        self.specs = specs
        self.nbytes = sum(s.nbytes for s in specs)
        self.plans: list[BucketPlan] = plan_buckets(specs, capacity_bytes=capacity_bytes)
        self.transport = transport
        self.timeout_s = timeout_s
        self.engines: dict[str, EngineState] = {}
        self.calls = EngineCalls(self.engines, timeout_s=timeout_s)
        self.verifier = Verifier(self.calls, specs, allow_unchecked=allow_unchecked)
        # This sender's name on the engines: an update it opened is refused to other senders,
        # and their buckets and aborts do not touch it (weightsync/engine/session.py).
        self.owner = f"trainer {socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._last_names: list[str] = []
        # bucket index -> (its plan, (buffer address, size), names, views, their hashing)
        self._views: dict[int, tuple[BucketPlan, tuple[int, int], list, list, KeptHashes]] = {}
        self.num_syncs = 0
        self.staged = staged
        self.switch_lead_s = switch_lead_s

    def add_engine(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float | None = None,
        accept: Mapping[str, str] | None = None,
    ) -> RefitAnswer:
        """Check refit info with the engine (nothing is written) and remember it.

        `timeout_s` bounds this first call, which also waits for an engine still starting;
        `accept`: `SyncOptions.accept_unkept`."""
        if endpoint.name in self.engines:
            raise ValueError(f"engine {endpoint.name!r} is registered already")
        answer = from_wire(
            "check_refit",
            endpoint.call(
                "check_refit",
                specs_to_dicts(self.specs),
                *((dict(accept),) if accept else ()),
                timeout_s=timeout_s or self.timeout_s,
            ),
        )
        self.engines[endpoint.name] = EngineState(
            endpoint=endpoint, param_of=answer.param_of, unverifiable=answer.unverifiable
        )
        if self.transport is not None:
            self.transport.forget_replays()  # the new engine holds none of them
        return answer

    def unverifiable(self, names: list[str]) -> str | None:
        """Why engines among `names` cannot be verified (stock engines), or None."""
        whys = [
            f"engine {n!r}: {self.engines[n].unverifiable}"
            for n in names
            if n in self.engines and self.engines[n].unverifiable
        ]
        return "; ".join(whys) or None

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`method(*args)` on engine `name`; its answer as `EngineCalls.wait_all` gives it."""
        return self.calls.call(name, method, *args, timeout_s=timeout_s)

    def _wait_loads(self, calls: list[Call], loads: _Loads) -> None:
        """Wait for `load_bucket` calls, adding each engine's answer to `loads`; the
        transport then orders what comes next after the engines' reads (`released`)."""
        reports: list[LoadReport] = self.calls.wait_all(calls)
        for (name, _, _), report in zip(calls, reports):
            loads.add(name, report)
        if reports and self.transport is not None:
            self.transport.released([report.released for report in reports])

    def _began(self, answers: list[BeginAnswer]) -> None:
        """After `begin` on engines, by any path: where another trainer's update came between
        on any of them, its receivers may have dropped this sender's bucket views, so every
        bucket is described in full next time (`BeginAnswer.replays`)."""
        if self.transport is not None and not all(answer.replays for answer in answers):
            self.transport.forget_replays()

    def _bucket_views(
        self, plan: BucketPlan, buffer: torch.Tensor
    ) -> tuple[list[str], list[torch.Tensor], KeptHashes]:
        """The names and views of `plan`'s tensors in `buffer`, and how they were hashed: made
        once per bucket, kept while its buffer is the same memory (verified syncs hash each
        bucket without per-tensor work from the second on)."""
        where = (buffer.data_ptr(), buffer.numel())
        kept = self._views.get(plan.index)
        if kept is None or kept[0] is not plan or kept[1] != where:
            names = [meta.name for meta in plan.tensors]
            views = [tensor_view(buffer, meta) for meta in plan.tensors]
            kept = self._views[plan.index] = (plan, where, names, views, KeptHashes())
        return kept[2], kept[3], kept[4]

    def sync(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]] | None,
        *,
        version: str,
        engines: list[str] | None = None,
        verify: bool = False,
        write_bucket: Callable[[BucketPlan, int, torch.Tensor], None] | None = None,
        probe: dict[str, dict] | None = None,
        peers: SyncPeers | None = None,
    ) -> SyncReport:
        """Send every tensor of `tensors` (in refit-info order) to `engines` (default: all).

        Instead of `tensors`, `write_bucket(plan, slot, buffer)` may fill each bucket itself
        (the trainer's ranks writing their own shards into shared memory). `probe`: {engine:
        `ProbeRequest.to_dict()`} for the engines that score a probe at `end`
        (weightsync/wire/probe.py). With `verify`, an engine whose workers hold slices and whose
        placements were not known when the sync began (its first sync) is checked before `end`
        from the tensors read again (`peers.worker_prints`; without `peers`, `tensors` again,
        which must then be a list: `Verifier.reread`)."""
        transport = self.transport
        if transport is None:
            raise ValueError("sync without a transport; set WeightSender.transport first")
        if tensors is None and write_bucket is None:
            raise ValueError("sync without tensors: give `tensors` or `write_bucket`")
        names = list(self.engines) if engines is None else list(engines)
        unknown = [n for n in names if n not in self.engines]
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}; registered: {list(self.engines)}")
        num_slots = transport.num_slots
        if names != self._last_names:  # some receiver missed earlier syncs' descriptions
            transport.forget_replays()
        self._last_names = names
        # Transports that can pass the tensors themselves (CUDA IPC) take them in `attach`.
        attach = transport.attach if (transport.takes_tensors and write_bucket is None) else None
        in_flight: dict[int, list[Call]] = {}
        sent = SentPrints(self.engines, names, self.verifier.specs) if verify else None
        loads = _Loads()
        start = time.perf_counter()
        begin = (version, False, self.owner, True) if self.staged else (version, False, self.owner)
        self._began(self.calls.call_all("begin", *begin, names=names))
        try:

            def wait_slot(plan: BucketPlan) -> int:
                slot = plan.index % num_slots
                self._wait_loads(in_flight.pop(slot, []), loads)
                return slot

            def get_buffer(plan: BucketPlan) -> torch.Tensor:
                return transport.buffer(wait_slot(plan), plan.nbytes)

            if write_bucket is not None:
                filled = _write_each(self.plans, get_buffer, write_bucket, num_slots)
            elif tensors is None:  # checked above: the type checker cannot see it
                raise ValueError("sync without tensors: give `tensors` or `write_bucket`")
            elif attach is not None:
                filled = _attach_each(
                    self.plans, iter(tensors), wait_slot, attach, sent.add if sent else None
                )
            else:
                filled = fill_buckets(self.plans, iter(tensors), get_buffer)
            for plan in filled:
                slot = plan.index % num_slots
                handle = transport.describe(slot, plan.index)
                descriptor = (
                    BucketDescriptor(
                        index=plan.index, nbytes=plan.nbytes, tensors=[], handle=handle
                    )
                    if handle.get("same")
                    else plan.descriptor(handle)
                ).to_dict()
                descriptor["update"] = version  # engines refuse another update's buckets
                in_flight[slot] = [self.calls.submit(n, "load_bucket", descriptor) for n in names]
                transport.send(slot, plan.nbytes)
                if sent and attach is None:
                    sent.add(*self._bucket_views(plan, transport.buffer(slot, plan.nbytes)))
            if peers is not None:
                peers.filled()
            for slot in list(in_flight):
                self._wait_loads(in_flight.pop(slot), loads)
                if peers is not None:
                    peers.alive()
            checked = None
            if sent:  # stage, verify, then commit: nothing failed is ever adopted
                prints, worker_sent = sent.result(), sent.worker_results()
                staged = self.verifier.stage_all(version, names, prints, worker_sent=worker_sent)
                if peers is not None:
                    peers.alive()
                checked = self.verifier.check_staged(
                    staged, prints, version=version, worker_sent=worker_sent
                )
                if checked.pending:  # placements learned just now: the tensors read again
                    read = time.perf_counter()
                    worker_sent.update(
                        peers.worker_prints(checked.pending)
                        if peers is not None
                        else self.verifier.reread(tensors, checked.pending, version=version)
                    )
                    read_s = time.perf_counter() - read
                    again = self.verifier.check_staged(
                        {n: staged[n] for n in checked.pending},
                        prints,
                        version=version,
                        worker_sent=worker_sent,
                    )
                    checked = checked.merged(again)
                    checked = VerifyReport(
                        engines=checked.engines, verify_s=checked.verify_s + read_s
                    )
            ends = self._end_all(version, names, probe)
            for name, end in zip(names, ends):
                # Engines that learn the tensor -> parameter map while loading report it here.
                if end.param_of is not None:
                    self.engines[name].param_of = end.param_of
                if end.placements is not None:
                    self.engines[name].placements = end.placements
        except BaseException as exc:
            transport.forget_replays()
            self.calls.abort(names, f"{type(exc).__name__}: {exc}", self.owner)
            raise
        sync_s = time.perf_counter() - start
        self.num_syncs += 1
        if checked is not None:  # the sync proper leaves out the checking
            sync_s -= checked.verify_s
        return SyncReport(
            version=version,
            path="buckets",
            nbytes=self.nbytes,
            num_buckets=len(self.plans),
            sync_s=sync_s,
            verify=checked,
            engines={
                n: EngineSyncReport.of(
                    e,
                    path="buckets",
                    load_s=loads.seconds.get(n, 0.0),
                    loader_tensors=loads.loader_tensors.get(n),
                )
                for n, e in zip(names, ends)
            },
        )

    def sync_one_copy(
        self,
        write: Callable[[list[str], list[str]], dict[str, Any] | None],
        *,
        version: str,
        engines: list[str],
        verify: bool = False,
        sharing: dict[str, list[str]] | None = None,
        probe: dict[str, dict] | None = None,
    ) -> tuple[SyncReport | None, list[str]]:
        """The one-copy path (weightsync/trainer/one_copy/targets.py) into engines whose parameters are shared.

        begin(version, one_copy=...) on each: the sharings the trainer holds mapped for it
        (`sharing[name]`: its workers' segment names or CUDA export owners; an engine shared
        otherwise now answers why not and takes buckets), or True where `sharing` names none;
        then `write(one_copy, fallback)` has every trainer
        rank write its shards into the one-copy engines' parameters and returns, when verifying,
        {"pieces": how many were written, "mismatched": names whose bytes read back differed};
        a difference aborts the update and raises; then end, where each engine confirms its
        parameters still are the bytes written (see weightsync/trainer/one_copy/targets.py). `write` is called
        even when no engine can take the path, so the trainer's ranks stay in step. Returns the
        report (None without one-copy engines) and the engines to sync by buckets instead (their
        parameters are no longer shared)."""
        start = time.perf_counter()
        one_copy: list[str] = []
        failure: BaseException | None = None
        phases: dict[str, float] = {}
        try:
            sharing = sharing or {}
            answers: list[BeginAnswer] = self.calls.wait_all(
                [
                    self.calls.submit(n, "begin", version, sharing.get(n, True), self.owner)
                    for n in engines
                ]
            )
            phases["begin"] = time.perf_counter() - start
            self._began(answers)
            for name, answer in zip(engines, answers):
                if answer.one_copy:
                    one_copy.append(name)
                else:
                    logger.info("engine %r takes buckets this sync: %s", name, answer.why)
        except BaseException as exc:
            failure, one_copy = exc, []
            self.calls.abort(engines, f"{type(exc).__name__}: {exc}", self.owner)
        fallback = [n for n in engines if n not in one_copy] if failure is None else []
        checked: VerifyReport | None = None
        try:
            written = write(one_copy, fallback) or {}
            if failure is not None:
                raise failure
            written_s = time.perf_counter() - start
            phases["write"] = written_s - phases["begin"]
            if one_copy and verify:
                # Checked before `end`: an engine whose bytes differ is aborted, never served.
                checked = self.verifier.check_one_copy(written, engines=one_copy, version=version)
            ends = self._end_all(version, one_copy, probe)
        except BaseException as exc:
            if failure is None:
                self.calls.abort(one_copy, f"{type(exc).__name__}: {exc}", self.owner)
            raise
        if not one_copy:
            return None, fallback
        sync_s = time.perf_counter() - start
        self.num_syncs += 1
        if checked is not None:  # the sync proper ends where checking began
            sync_s -= checked.verify_s
        phases["end"] = sync_s - written_s
        report = SyncReport(
            version=version,
            path="one_copy",
            nbytes=self.nbytes,
            num_buckets=0,
            sync_s=sync_s,
            phases_s=phases,
            bytes_written=int(written.get("bytes", 0)),
            verify=checked,
            engines={n: EngineSyncReport.of(e, path="one_copy") for n, e in zip(one_copy, ends)},
        )
        return report, fallback

    def sync_p2p(
        self,
        send: Callable[[bool], dict[str, Any]],
        *,
        version: str,
        engines: list[str],
        verify: bool = False,
        probe: dict[str, dict] | None = None,
        peers: SyncPeers | None = None,
    ) -> SyncReport:
        """The point-to-point path (weightsync/transports/p2p.py) into engines that joined the
        trainer's transfer plan: begin on each, every worker receiving (`p2p_receive`) while
        `send(True)` has every trainer rank send its own pieces (it returns {"bytes": per
        rank, "send_s": per rank, and with `verify` "worker_sent": per engine, each worker's
        expected fingerprints, which the ranks hashed from what they sent}); with `verify`,
        staged and checked worker by worker before `end`. `send(False)` when no engine began,
        so the ranks stay in step. `peers` hears when the ranks' part is over and whether the
        sync failed after it. Any failure aborts every engine."""
        start = time.perf_counter()
        phases: dict[str, Any] = {}
        try:
            self._began(self.calls.call_all("begin", version, False, self.owner, names=engines))
        except BaseException as exc:
            self.calls.abort(engines, f"{type(exc).__name__}: {exc}", self.owner)
            send(False)
            raise
        checked: VerifyReport | None = None
        try:
            phases["begin"] = time.perf_counter() - start
            receiving = [self.calls.submit(n, "p2p_receive", version) for n in engines]
            sent = send(True)
            if peers is not None:  # the other ranks sent: they follow the checks from here
                peers.filled()
            reports: list[LoadReport] = self.calls.wait_all(receiving)
            phases["send"] = time.perf_counter() - start - phases["begin"]
            phases["rank_send"] = sent["send_s"]
            if peers is not None:
                peers.alive()
            if verify:  # each rank hashed what it sent (`send`'s "worker_sent")
                worker_sent = sent["worker_sent"]
                staged = self.verifier.stage_all(version, engines, {}, worker_sent=worker_sent)
                if peers is not None:
                    peers.alive()
                checked = self.verifier.check_staged(
                    staged, {}, version=version, worker_sent=worker_sent
                )
            ends = self._end_all(version, engines, probe)
        except BaseException as exc:
            self.calls.abort(engines, f"{type(exc).__name__}: {exc}", self.owner)
            raise
        sync_s = time.perf_counter() - start
        self.num_syncs += 1
        if checked is not None:  # the sync proper leaves out the checking
            sync_s -= checked.verify_s
        phases["end"] = sync_s - phases["begin"] - phases["send"]
        return SyncReport(
            version=version,
            path="p2p",
            nbytes=self.nbytes,
            num_buckets=0,
            sync_s=sync_s,
            phases_s=phases,
            bytes_written=sum(sent["bytes"]),
            rank_bytes=list(sent["bytes"]),
            verify=checked,
            engines={
                n: EngineSyncReport.of(e, path="p2p", load_s=r.seconds)
                for n, e, r in zip(engines, ends, reports)
            },
        )

    def _end_all(
        self, version: str, names: list[str], probe: dict[str, dict] | None
    ) -> list[EndReport]:
        """`end` on every engine of `names` at once, with its probe where it has one; a staged
        sync into several engines names the instant they all switch at (`switch_lead_s`), and
        switches in all of them or in none (weightsync/trainer/switches.py)."""
        probe = probe or {}
        calls = []
        if self.staged and len(names) > 1 and self.switch_lead_s > 0:
            at = time.time() + self.switch_lead_s
            for n in names:
                known = known_maps(self.engines[n].placements, self.engines[n].param_of) or None
                calls.append(self.calls.submit(n, "end", version, probe.get(n), known, at))
            return end_all_or_none(self.calls, calls, version)
        for n in names:
            known = known_maps(self.engines[n].placements, self.engines[n].param_of)
            if known:  # placements and the map it holds whole are not sent again
                calls.append(self.calls.submit(n, "end", version, probe.get(n), known))
            elif n in probe:
                calls.append(self.calls.submit(n, "end", version, probe[n]))
            else:
                calls.append(self.calls.submit(n, "end", version))
        if self.staged and len(names) > 1:  # switched in every engine or in none
            return end_all_or_none(self.calls, calls, version)
        return self.calls.wait_all(calls)

    def verify_one_copy(self, written: dict[str, Any], *, engines: list[str]) -> VerifyReport:
        """The ranks' read-back comparison of the bytes (each engine's `end` then confirms its
        parameters still are those bytes, or fails)."""
        return self.verifier.verify_one_copy(written, engines=engines)

    def verify(
        self,
        sent: Sent,
        *,
        engines: list[str],
        worker_sent: dict[str, list[dict[str, Fingerprint]]] | None = None,
    ) -> VerifyReport:
        """Compare the engines' parameter fingerprints with what was sent (`sent`: trainer
        tensor -> fingerprint, or their `SentTable`). A tensor-parallel engine is compared worker by worker with
        `worker_sent[engine]` (per worker, parameter -> fingerprint of the slices it holds,
        `placement.WorkerPrints`); without it its result is pending (`verified` None): the
        caller computes it from the tensors and verifies again."""
        return self.verifier.verify(sent, engines=engines, worker_sent=worker_sent)

    def close(self) -> None:
        self._views.clear()  # they hold the transport's buffers
        if self.transport is not None:
            self.transport.close()


def _write_each(
    plans: list[BucketPlan],
    get_buffer: Callable[[BucketPlan], torch.Tensor],
    write_bucket: Callable[[BucketPlan, int, torch.Tensor], None],
    num_slots: int,
) -> Iterator[BucketPlan]:
    for plan in plans:
        write_bucket(plan, plan.index % num_slots, get_buffer(plan))
        yield plan


def _attach_each(
    plans: list[BucketPlan],
    tensors: Iterator[tuple[str, torch.Tensor]],
    wait_slot: Callable[[BucketPlan], int],
    attach: Callable[[int, BucketPlan, list[torch.Tensor]], None],
    record: Callable[[list[str], list[torch.Tensor]], None] | None,
) -> Iterator[BucketPlan]:
    """Hand each bucket's tensors to the transport's `attach(slot, plan, tensors)`, which
    passes them in place (no copy into a bucket); `record` takes each for verification."""
    for plan in plans:
        slot = wait_slot(plan)
        bucket = take_bucket(plan, tensors)
        attach(slot, plan, bucket)
        if record is not None:
            record([meta.name for meta in plan.tensors], bucket)
        yield plan
    check_stream_end(tensors)


class _Loads:
    """Each engine's `load_bucket` answers of one sync, summed: seconds, and the tensors it
    handed to its own loader (None once an answer did not count them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.loader_tensors: dict[str, int | None] = {}

    def add(self, name: str, report: LoadReport) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + report.seconds
        before = self.loader_tensors.get(name, 0)
        counted = report.loader_tensors
        self.loader_tensors[name] = None if before is None or counted is None else before + counted
