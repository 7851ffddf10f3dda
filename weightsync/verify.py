"""Verification: whether each engine holds the bytes the trainer sent.

Runs on the sending rank, inside `WeightSender` (which owns the engines and the calls to them).
After a sync by buckets each engine's workers report `worker_fingerprints()` of their
parameters, computed in the engine process, and each is compared with the fingerprint expected
from what was sent, placed where the engine's own loader puts each tensor (its placements,
weightsync/placement.py): fingerprints are position-sensitive (weightsync/fingerprint.py), so a
transposed tensor, swapped rows or a swapped q and k inside a fused parameter are caught. Where
every tensor lies whole in its parameter (TP=1) the expected values follow from the sent
tensors' fingerprints; a worker that holds slices needs the tensors again (`pending`). A
receiver that reports no placements is compared through `fingerprints()` for the parameters
one tensor fills from its first word. On the one-copy path the ranks read their own writes
back instead, and an engine whose bytes differ is aborted before `end`.
"""

from __future__ import annotations

import time
from typing import Any

from weightsync.endpoint import EngineCalls
from weightsync.fingerprint import Fingerprint, expected_fingerprints
from weightsync.placement import placed_params, prints_from_sent
from weightsync.wire import TensorSpec


class Verifier:
    """Compares engines' parameter fingerprints, or the ranks' read-back, with what was sent."""

    def __init__(self, calls: EngineCalls, specs: list[TensorSpec]) -> None:
        self.calls = calls
        self.engines = calls.engines
        self.specs = {spec.name: spec for spec in specs}

    def verify(self, sent: dict[str, Fingerprint], *, engines: list[str],
               worker_sent: dict[str, list[dict[str, Fingerprint]]] | None = None,
               ) -> dict[str, Any]:
        """`WeightSender.verify`: {engine: {"verified", "mismatched", "num_checked"},
        "verify_s"}; a tensor-parallel engine without `worker_sent` is left pending."""
        start = time.perf_counter()
        worker_sent = dict(worker_sent or {})
        out: dict[str, Any] = {}
        asked = []
        for name in engines:
            placements = self.engines[name].placements
            if placements is None:
                asked.append((name, "fingerprints"))
                continue
            if name not in worker_sent:
                want = [prints_from_sent(p, sent, self.specs) for p in placements]
                if all(w is not None for w in want):
                    worker_sent[name] = want
            if name in worker_sent:
                asked.append((name, "worker_fingerprints"))
            else:
                out[name] = {"verified": None, "pending": True, "mismatched": [],
                             "num_checked": 0}
        calls = [self.calls.submit(n, method) for n, method in asked]
        for (name, method), prints in zip(asked, self.calls.wait_all(calls)):
            state = self.engines[name]
            if method == "fingerprints":
                expected = expected_fingerprints(state.param_of, sent)
                bad = _mismatched(expected, prints)
                out[name] = {"verified": not bad and bool(expected), "mismatched": bad,
                             "num_checked": len(expected)}
                continue
            bad, checked = [], 0
            for rank, (placements, want, got) in enumerate(
                    zip(state.placements, worker_sent[name], prints)):
                placed = placed_params(state.param_of, placements)
                expected = {p: fp for p, fp in want.items() if p in placed}
                bad += [f"worker {rank}: {p}" for p in _mismatched(expected, got)]
                checked += len(expected)
            out[name] = {"verified": not bad and checked > 0, "mismatched": bad,
                         "num_checked": checked, "num_workers": len(prints)}
        out["verify_s"] = time.perf_counter() - start
        return out

    def verify_direct(self, written: dict[str, Any], *, engines: list[str]) -> dict[str, Any]:
        """`WeightSender.verify_direct`: the ranks' read-back, the same for every engine."""
        start = time.perf_counter()
        pieces = int(written.get("pieces", 0))
        bad = sorted(set(written.get("mismatched", [])))
        out: dict[str, Any] = {name: {"verified": not bad and pieces > 0, "mismatched": bad,
                                      "num_checked": pieces} for name in engines}
        out["verify_s"] = time.perf_counter() - start
        return out

    def check_direct(self, written: dict[str, Any], *, engines: list[str],
                     version: str) -> dict[str, Any]:
        """`verify_direct`, raising where an engine's bytes differ (the update is aborted)."""
        checked = self.verify_direct(written, engines=engines)
        bad = {n: checked[n]["mismatched"] for n in engines if not checked[n]["verified"]}
        if bad:
            raise RuntimeError(f"verification failed, update {version!r} aborted: "
                               f"bytes differ from the trainer's in {bad}")
        return checked


def _mismatched(expected: dict[str, Fingerprint], actual: dict[str, Any]) -> list[str]:
    return sorted(p for p, fp in expected.items()
                  if p not in actual or tuple(actual[p]) != tuple(fp))
