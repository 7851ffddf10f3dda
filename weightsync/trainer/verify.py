"""Verification: whether each engine holds the bytes the trainer sent.

Runs on the sending rank, inside `WeightSender` (which owns the engines and the calls to them).
Each engine's workers fingerprint their parameters in the engine process, and each parameter is
compared with the fingerprint expected from what was sent, placed where the engine's own loader
puts each tensor (its placements, weightsync/wire/placement.py). Fingerprints are position-sensitive
(weightsync/wire/fingerprint.py): a transposed tensor, swapped rows or q and k swapped inside a fused
parameter fail. Where every tensor lies whole in its parameter (TP=1) the expected values follow
from the sent tensors' fingerprints; a worker that holds slices needs the tensors' elements
(`worker_sent`, `placement.WorkerPrints`), without which its result is left `pending`. A
receiver that reports no placements is compared for the parameters one tensor fills from its
first word.

Stage, verify, commit: a verified sync by buckets asks every engine to `stage` (report what the
open update holds) before `end`; `check_staged` raises `VerificationFailed` where an engine's
bytes differ, and the sender aborts the update, so no engine adopts, or serves, weights that
failed (with keep_previous the engine puts its previous weights back). `verify` checks engines
at any other time. On the one-copy path the ranks read their own writes back instead
(`check_direct`), and an engine whose bytes differ is aborted before `end` too.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from weightsync.trainer.endpoint import EngineCalls
from weightsync.wire.errors import VerificationFailed
from weightsync.wire.fingerprint import (
    Fingerprint,
    FingerprintBatch,
    KeptHashes,
    expected_fingerprints,
    prints_digest,
    sole_holders,
    table_prints,
)
from weightsync.wire.placement import (
    WholePrints,
    WorkerPrints,
    placed_params,
    prints_from_sent,
    sliced,
)
from weightsync.wire.protocol import EngineVerification, StageReport, VerifyReport, known_maps
from weightsync.wire.specs import TensorSpec

if TYPE_CHECKING:
    import torch

WorkerSent = dict[str, list[dict[str, Fingerprint]]]


class SentTable:
    """What a verified sync sent, as the fingerprints' [N, 3] table
    (`FingerprintBatch.read_table`, row i for `names[i]`): what `Verifier` computes the
    expected fingerprints from without a step per tensor (`WholePrints`), and, made when first
    asked, the same as {name: fingerprint} (`prints`)."""

    def __init__(self, names: list[str], table: torch.Tensor) -> None:
        self.names = names
        self.table = table
        self._prints: dict[str, Fingerprint] | None = None

    def prints(self) -> dict[str, Fingerprint]:
        if self._prints is None:
            self._prints = dict(zip(self.names, table_prints(self.table)))
        return self._prints


Sent = dict[str, Fingerprint] | SentTable  # what `check_staged` compares with


class SentPrints:
    """What a verified sync sent, collected bucket by bucket as the tensors stream past: each
    tensor's fingerprint (hashed in batches), and for engines whose workers hold slices (their
    placements known) each worker's expected fingerprints (`placement.WorkerPrints`)."""

    def __init__(
        self, engines: dict[str, Any], names: list[str], specs: dict[str, TensorSpec]
    ) -> None:
        self._batch = FingerprintBatch()
        self._order: list[str] = []
        self._table: SentTable | None = None
        self._workers = {
            n: WorkerPrints(engines[n].placements)
            for n in names
            if engines[n].placements is not None
            and any(sliced(p, specs) for p in engines[n].placements)
        }

    def add(
        self, names: list[str], tensors: list[torch.Tensor], kept: KeptHashes | None = None
    ) -> None:
        """One bucket's tensors, hashed before its memory is reused. `kept`: how the same list
        was hashed last time (`FingerprintBatch.add_all`): no per-tensor work then."""
        self._order.extend(names)
        self._batch.add_all(tensors, kept)
        for prints in self._workers.values():
            for name, tensor in zip(names, tensors):
                prints.add(name, tensor)

    def result(self) -> SentTable:
        """The fingerprints of every tensor added, read once."""
        if self._table is None:
            self._table = SentTable(self._order, self._batch.read_table())
        return self._table

    def worker_results(self) -> WorkerSent:
        return {n: w.result() for n, w in self._workers.items()}


class Verifier:
    """Compares engines' parameter fingerprints, or the ranks' read-back, with what was sent."""

    def __init__(
        self, calls: EngineCalls, specs: list[TensorSpec], *, allow_unchecked: bool = False
    ) -> None:
        self.calls = calls
        self.engines = calls.engines
        self.specs = {spec.name: spec for spec in specs}
        # False: a verified sync fails when an engine holds a parameter it could not compare.
        self.allow_unchecked = allow_unchecked
        # engine -> (its param_of, `sole_holders` of it): made once per map the engine reports
        self._holders: dict[str, tuple[dict, dict[str, str]]] = {}
        # engine -> (the digests its last `stage` was sent, the parameters they cover)
        self._digested: dict[str, tuple[list[str], int]] = {}

    def verify(
        self,
        sent: Sent,
        *,
        engines: list[str],
        worker_sent: WorkerSent | None = None,
    ) -> VerifyReport:
        """`WeightSender.verify`: each engine's parameters compared with what was sent; an
        engine whose workers hold slices, without `worker_sent`, is left pending."""
        start = time.perf_counter()
        out: dict[str, EngineVerification] = {}
        asked = []
        for name in engines:
            want = self._expected(name, sent, worker_sent or {})
            if want is None:
                out[name] = _pending()
            else:
                method = "fingerprints" if want == "by-name" else "worker_fingerprints"
                asked.append((name, want, self.calls.submit(name, method)))
        answers = self.calls.wait_all([call for _, _, call in asked])
        for (name, want, _), prints in zip(asked, answers):
            workers = [prints] if want == "by-name" else prints
            out[name] = self._compare(name, want, workers, _prints(sent))
        return VerifyReport(engines=out, verify_s=time.perf_counter() - start)

    def stage_all(
        self,
        version: str,
        names: list[str],
        sent: Sent,
        *,
        worker_sent: WorkerSent | None = None,
    ) -> dict[str, StageReport]:
        """Every engine of `names`' `stage` answer, asked at once. Each is sent the digest of
        what each of its workers must hold (`prints_digest`) where that is known already (a
        layout seen in an earlier sync): an engine whose fingerprints digest to it answers
        `same` in a few bytes, not one fingerprint per parameter (`check_staged` then counts
        it verified); the others answer them all."""
        calls = []
        for name in names:
            expect = self._digests(name, sent, worker_sent or {})
            calls.append(self.calls.submit(name, "stage", version, expect))
        return dict(zip(names, self.calls.wait_all(calls)))

    def _digests(self, name: str, sent: Sent, worker_sent: WorkerSent) -> list[str] | None:
        self._digested.pop(name, None)
        if self.engines[name].param_of is None:
            return None  # nothing known yet of where the tensors land
        want = self._expected(name, sent, worker_sent)
        if want is None:
            return None
        wanted = self._wanted(name, want, _prints(sent))
        digests = [prints_digest(prints) for prints in wanted]
        self._digested[name] = (digests, sum(map(len, wanted)))
        return digests

    def check_staged(
        self,
        staged: dict[str, StageReport],
        sent: Sent,
        *,
        version: str,
        worker_sent: WorkerSent | None = None,
    ) -> VerifyReport:
        """Compare what each engine's open update holds (its `stage` answer) with what was
        sent; raise `VerificationFailed` naming the engines and parameters that differ, and,
        unless `allow_unchecked`, those that could not be compared (a parameter a tensor lands
        in whose loader does not copy verbatim). `sent`: {tensor: fingerprint}, or
        `SentPrints.result()`'s table."""
        start = time.perf_counter()
        out: dict[str, EngineVerification] = {}
        for name, report in staged.items():
            state = self.engines[name]
            if report.same:  # every worker's fingerprints digest to what it was sent
                out[name] = self._same(name)
                continue
            if report.param_of is not None:
                state.param_of = report.param_of
            if report.placements is not None and known_maps(report.placements) != known_maps(
                state.placements
            ):  # placements only grow: the same sizes are the same placements, kept as they
                # are so that what is computed from them once (`WholePrints`) is kept too
                state.placements = report.placements
            want = self._expected(name, sent, worker_sent or {})
            out[name] = (
                _pending()
                if want is None
                else self._compare(name, want, report.fingerprints, _prints(sent))
            )
        checked = VerifyReport(engines=out, verify_s=time.perf_counter() - start)
        bad = {n: r.mismatched for n, r in out.items() if r.mismatched}
        if bad:
            raise VerificationFailed(
                f"verification failed, update {version!r} aborted before any engine adopted "
                f"it: the staged bytes differ from the trainer's in {bad}",
                checked.to_dict(),
            )
        unchecked = {n: r.unchecked for n, r in out.items() if r.unchecked}
        if unchecked and not self.allow_unchecked:
            raise VerificationFailed(
                f"verification incomplete, update {version!r} aborted before any engine adopted "
                f"it: parameters the trainer's tensors land in could not be compared (their "
                f"loaders do not copy the tensors verbatim, so no check knows what they must "
                f"hold): {_first(unchecked)}; SyncOptions(allow_unchecked=True) accepts a "
                f"partial check (the report lists them as `unchecked`)",
                checked.to_dict(),
            )
        return checked

    def reread(
        self, tensors: Any, engines: list[str], *, version: str
    ) -> dict[str, list[dict[str, Fingerprint]]]:
        """What each of `engines`' workers must hold (`WorkerPrints`), from `tensors` read
        again: the engines whose workers hold slices and whose placements were learned in this
        sync (`check_staged` left them pending). Only a list or tuple can be read again; from
        anything else (an iterator, read once) no pending engine may adopt the update, so it
        raises `VerificationFailed` (the sender then aborts it)."""
        if not isinstance(tensors, list | tuple):
            raise VerificationFailed(
                f"verification incomplete, update {version!r} aborted before any engine adopted "
                f"it: the workers of {engines} hold slices and where the tensors land in them was "
                f"learned in this sync, so their bytes can be checked only from the tensors read "
                f"again, and `tensors` was read once ({type(tensors).__name__}); pass a list, or "
                f"sync through TrainerSync (which reads them again)",
                {n: _pending().to_dict() for n in engines},
            )
        workers = {n: WorkerPrints(self.engines[n].placements or []) for n in engines}
        for name, tensor in tensors:
            for prints in workers.values():
                prints.add(name, tensor)
        return {n: w.result() for n, w in workers.items()}

    def _expected(
        self,
        name: str,
        sent: Sent,
        worker_sent: WorkerSent,
    ) -> str | list[dict[str, Fingerprint]] | None:
        """Per worker, what its parameters must fingerprint to; "by-name" for a receiver
        without placements; None when that needs the tensors again (pending). From a
        `SentTable`, by the worker's kept `WholePrints`."""
        placements = self.engines[name].placements
        if placements is None:
            return "by-name"
        if name in worker_sent:
            return worker_sent[name]
        want = []
        for worker in placements:
            if isinstance(sent, SentTable):
                plan = WholePrints.of(worker, sent.names, self.specs)
                prints = plan.prints(sent.table) if plan.whole else None
            else:
                prints = prints_from_sent(worker, sent, self.specs)
            if prints is None:
                return None
            want.append(prints)
        return want

    def _compare(
        self,
        name: str,
        want: str | list[dict[str, Fingerprint]],
        workers: list[dict[str, Any]],
        sent: dict[str, Fingerprint],
    ) -> EngineVerification:
        wanted = self._wanted(name, want, sent)
        if isinstance(want, str) or self.engines[name].placements is None:  # "by-name"
            expected = wanted[0]
            bad = _mismatched(expected, workers[0])
            return EngineVerification(
                verified=not bad and bool(expected),
                mismatched=bad,
                num_checked=len(expected),
                unchecked=sorted(set(workers[0]) - set(expected)),
            )
        bad, checked, unchecked = [], 0, []
        for rank, (expected, got) in enumerate(zip(wanted, workers)):
            bad += [f"worker {rank}: {p}" for p in _mismatched(expected, got)]
            checked += len(expected)
            unchecked += [f"worker {rank}: {p}" for p in sorted(set(got) - set(expected))]
        return EngineVerification(
            verified=not bad and checked > 0,
            mismatched=bad,
            num_checked=checked,
            num_workers=len(workers),
            unchecked=unchecked,
        )

    def _wanted(
        self, name: str, want: str | list[dict[str, Fingerprint]], sent: dict[str, Fingerprint]
    ) -> list[dict[str, Fingerprint]]:
        """Per worker (one for "by-name"), {parameter: fingerprint} it must hold: `want`'s
        parameters where the worker's placements put a trainer tensor."""
        state = self.engines[name]
        if isinstance(want, str) or state.placements is None:  # "by-name"
            kept = self._holders.get(name)
            if kept is None or kept[0] is not state.param_of:
                kept = self._holders[name] = (state.param_of, sole_holders(state.param_of))
            return [expected_fingerprints(state.param_of, sent, kept[1])]
        out = []
        for placements, wanted in zip(state.placements, want):
            placed = placed_params(state.param_of, placements)
            out.append({p: fp for p, fp in wanted.items() if p in placed})
        return out

    def _same(self, name: str) -> EngineVerification:
        """An engine that answered `same`: it holds what its digests were made from."""
        digested = self._digested.pop(name, None)
        if digested is None:  # it was sent no digest: its answer cannot be right
            return EngineVerification(
                verified=False, mismatched=["its stage answer claims digests it was not sent"]
            )
        digests, checked = digested
        workers = None if self.engines[name].placements is None else len(digests)
        return EngineVerification(
            verified=checked > 0, num_checked=checked, num_workers=workers, by_digest=True
        )

    def verify_one_copy(self, written: dict[str, Any], *, engines: list[str]) -> VerifyReport:
        """`WeightSender.verify_one_copy`: the ranks' read-back, the same for every engine."""
        start = time.perf_counter()
        pieces = int(written.get("pieces", 0))
        bad = sorted(set(written.get("mismatched", [])))
        out = {
            name: EngineVerification(
                verified=not bad and pieces > 0, mismatched=list(bad), num_checked=pieces
            )
            for name in engines
        }
        return VerifyReport(engines=out, verify_s=time.perf_counter() - start)

    def check_one_copy(
        self, written: dict[str, Any], *, engines: list[str], version: str
    ) -> VerifyReport:
        """`verify_one_copy`, raising where an engine's bytes differ (the update is aborted)."""
        checked = self.verify_one_copy(written, engines=engines)
        bad = {n: checked[n].mismatched for n in engines if not checked[n].verified}
        if bad:
            raise VerificationFailed(
                f"verification failed, update {version!r} aborted: "
                f"bytes differ from the trainer's in {bad}",
                checked.to_dict(),
            )
        return checked


def _first(by_engine: dict[str, list[str]], most: int = 8) -> str:
    """{engine: names} for a message: the first `most` names of each, with how many more."""
    return "; ".join(
        f"{engine!r}: {names[:most]}"
        + (f" and {len(names) - most} more" if len(names) > most else "")
        for engine, names in by_engine.items()
    )


def _prints(sent: Sent) -> dict[str, Fingerprint]:
    return sent.prints() if isinstance(sent, SentTable) else sent


def _pending() -> EngineVerification:
    return EngineVerification(verified=None, pending=True)


def _mismatched(expected: dict[str, Fingerprint], actual: dict[str, Any]) -> list[str]:
    return sorted(
        p for p, fp in expected.items() if p not in actual or tuple(actual[p]) != tuple(fp)
    )
