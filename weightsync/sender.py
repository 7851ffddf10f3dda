"""The sender: streams a model's tensors through buckets into one or more engines.

Runs on the sending rank of the trainer (rank 0); the other ranks only take part in gathering.
One sync, for every engine at once:
  begin(version) -> for each bucket: fill a transport slot, load_bucket(descriptor) -> end(version)
With two slots the trainer gathers and packs bucket i+1 while the engines load bucket i; a slot
is reused only after every engine has finished loading what it held. Any failure aborts the
session on every engine (they keep their previous version tag) and is raised, naming the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.bucket import BucketPlan, fill_buckets, plan_buckets, tensor_view
from weightsync.endpoint import Endpoint
from weightsync.fingerprint import Fingerprint, fingerprint
from weightsync.receiver import expected_fingerprints
from weightsync.transports import SenderTransport
from weightsync.wire import TensorSpec, specs_to_dicts

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(kw_only=True, slots=True)
class EngineState:
    endpoint: Endpoint
    param_of: dict[str, list[str]] = field(default_factory=dict)


class WeightSender:
    """Plans buckets once from refit info, then runs syncs into registered engines."""

    def __init__(self, specs: list[TensorSpec], *, transport: SenderTransport | None,
                 capacity_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """`transport` may be set later (`self.transport = ...`), e.g. once the engines are
        known, as a collective transport needs their number."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be positive")
        self.specs = specs
        self.plans: list[BucketPlan] = plan_buckets(specs, capacity_bytes=capacity_bytes)
        self.transport = transport
        self.timeout_s = timeout_s
        self.engines: dict[str, EngineState] = {}
        self.num_syncs = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def add_engine(self, endpoint: Endpoint, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Check refit info with the engine (nothing is written) and remember it.

        `timeout_s` bounds this first call, which also waits for an engine still starting."""
        if endpoint.name in self.engines:
            raise ValueError(f"engine {endpoint.name!r} is registered already")
        answer = endpoint.call("check_refit", specs_to_dicts(self.specs),
                               timeout_s=timeout_s or self.timeout_s)
        self.engines[endpoint.name] = EngineState(endpoint=endpoint, param_of=answer["param_of"])
        return answer

    def _wait_all(self, tickets: list[tuple[str, Any]],
                  load_s: dict[str, float] | None = None) -> list[Any]:
        results = []
        for name, ticket in tickets:
            result = self.engines[name].endpoint.wait(ticket, timeout_s=self.timeout_s)
            if load_s is not None and isinstance(result, dict):
                load_s[name] = load_s.get(name, 0.0) + float(result.get("seconds", 0.0))
            results.append(result)
        return results

    def _broadcast(self, method: str, *args: Any, names: list[str]) -> list[Any]:
        tickets = [(n, self.engines[n].endpoint.submit(method, *args)) for n in names]
        return self._wait_all(tickets)

    def sync(self, tensors: Iterator[tuple[str, torch.Tensor]] | None, *, version: str,
             engines: list[str] | None = None, verify: bool = False,
             write_bucket: Callable[[BucketPlan, int, torch.Tensor], None] | None = None,
             ) -> dict[str, Any]:
        """Send every tensor of `tensors` (in refit-info order) to `engines` (default: all).

        Instead of `tensors`, `write_bucket(plan, slot, buffer)` may fill each bucket itself
        (the trainer's ranks writing their own shards into shared memory)."""
        if self.transport is None:
            raise ValueError("sync without a transport; set WeightSender.transport first")
        names = list(self.engines) if engines is None else list(engines)
        unknown = [n for n in names if n not in self.engines]
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}; registered: {list(self.engines)}")
        num_slots = getattr(self.transport, "num_slots", 1)
        in_flight: dict[int, list[tuple[str, Any]]] = {}
        sent: dict[str, Fingerprint] = {}
        load_s: dict[str, float] = {}
        start = time.perf_counter()
        self._broadcast("begin", version, names=names)
        try:

            def get_buffer(plan: BucketPlan) -> torch.Tensor:
                slot = plan.index % num_slots
                self._wait_all(in_flight.pop(slot, []), load_s)
                return self.transport.buffer(slot, plan.nbytes)

            if write_bucket is None:
                filled = fill_buckets(self.plans, tensors, get_buffer)
            else:
                filled = _write_each(self.plans, get_buffer, write_bucket, num_slots)
            for plan in filled:
                slot = plan.index % num_slots
                descriptor = plan.descriptor(self.transport.handle(slot)).to_dict()
                in_flight[slot] = [
                    (n, self.engines[n].endpoint.submit("load_bucket", descriptor)) for n in names
                ]
                self.transport.send(slot, plan.nbytes)
                if verify:
                    buffer = self.transport.buffer(slot, plan.nbytes)
                    for meta in plan.tensors:
                        sent[meta.name] = fingerprint(tensor_view(buffer, meta))
            for slot in list(in_flight):
                self._wait_all(in_flight.pop(slot), load_s)
            ends = self._broadcast("end", version, names=names)
            for name, end in zip(names, ends):
                # Engines that learn the tensor -> parameter map while loading report it here.
                if isinstance(end, dict) and "param_of" in end:
                    self.engines[name].param_of = end.pop("param_of")
        except BaseException as exc:
            self._abort(names, f"{type(exc).__name__}: {exc}")
            raise
        sync_s = time.perf_counter() - start
        self.num_syncs += 1
        report: dict[str, Any] = {
            "version": version, "nbytes": self.nbytes, "num_buckets": len(self.plans),
            "sync_s": sync_s, "gbps": self.nbytes / sync_s / 1e9 if sync_s > 0 else 0.0,
            "engines": {n: {"status": "ok", "load_s": load_s.get(n, 0.0), **(e or {})}
                        for n, e in zip(names, ends)},
        }
        if verify:
            report["verify"] = self.verify(sent, engines=names)
        return report

    def verify(self, sent: dict[str, Fingerprint], *, engines: list[str]) -> dict[str, Any]:
        """Compare the engines' parameter fingerprints with what was sent."""
        start = time.perf_counter()
        actual = self._broadcast("fingerprints", names=engines)
        out: dict[str, Any] = {}
        for name, prints in zip(engines, actual):
            expected = expected_fingerprints(self.engines[name].param_of, sent)
            bad = sorted(p for p, fp in expected.items()
                         if p not in prints or tuple(prints[p]) != tuple(fp))
            out[name] = {"verified": not bad and bool(expected), "mismatched": bad,
                         "num_checked": len(expected)}
        out["verify_s"] = time.perf_counter() - start
        return out

    def _abort(self, names: list[str], reason: str) -> None:
        for name in names:
            endpoint = self.engines[name].endpoint
            try:
                endpoint.call("abort", reason, timeout_s=min(self.timeout_s, 10.0))
            except Exception as exc:  # the engine may be the thing that failed
                logger.warning("abort on engine %r failed too: %s", name, exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _write_each(plans: list[BucketPlan], get_buffer: Callable[[BucketPlan], torch.Tensor],
                write_bucket: Callable[[BucketPlan, int, torch.Tensor], None],
                num_slots: int) -> Iterator[BucketPlan]:
    for plan in plans:
        write_bucket(plan, plan.index % num_slots, get_buffer(plan))
        yield plan
