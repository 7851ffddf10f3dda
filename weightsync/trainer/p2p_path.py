"""The trainer side of the point-to-point path (weightsync/transports/p2p.py), one per trainer rank.

After an engine's first sync by buckets, rank 0 holds where each of its workers' loaders put
every tensor (the placements of its `end` report). From the next sync on, every rank sends the
pieces of its own shards straight to the workers that keep them, as a transfer plan says
(weightsync/wire/transfer_plan.py): no byte passes through rank 0 but its own. The plan is made
once per set of engines (and made again when one joins or leaves): rank 0 gathers each rank's
holdings (which elements of which tensor it holds), plans, hosts the group's store, has every
engine's workers join (`p2p_open`) and hands the plan to the other ranks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from weightsync.trainer.source import DTensorV2Source, ShardPieces
from weightsync.trainer.sync_group import SyncGroup
from weightsync.transports.p2p import PointToPointSender
from weightsync.wire.fingerprint import Fingerprint, combine
from weightsync.wire.protocol import SyncReport
from weightsync.wire.specs import element_size
from weightsync.wire.transfer_plan import TransferPlan, plan_transfers

MAX_FAILURES = 2  # point-to-point syncs failed in a row before their engines keep buckets

if TYPE_CHECKING:
    import torch

    from weightsync.trainer.endpoint import EngineState
    from weightsync.trainer.sender import SyncPeers, WeightSender
    from weightsync.wire.specs import TensorSpec


def unsendable(source: DTensorV2Source, rank: int) -> str | None:
    """Why this rank cannot send its tensors as it holds them (the point-to-point path sends
    each rank's own pieces, unconverted), or None."""
    if ShardPieces(source, rank=rank).listed() is None:
        return (
            "some tensors reach the engines converted (a dtype other than the training one, "
            "SyncOptions.sync_dtype) or gathered (not sharded along dim 0, or converted by a "
            "state_dict_adapter): the point-to-point path sends each rank's own shards as they "
            "are; use SyncOptions(point_to_point=False)"
        )
    return None


def why_not(state: EngineState, specs: list[TensorSpec]) -> str | None:
    """Why an engine cannot take the point-to-point path from what it reported so far (each
    worker's placements must cover every tensor it loads), or None."""
    placements = state.placements
    if not placements:
        return "its workers reported no placements (where their loaders put each tensor)"
    param_of = state.param_of or {}
    for worker, placed in enumerate(placements):
        placed = placed or {}
        missing = [s.name for s in specs if param_of.get(s.name, True) and s.name not in placed]
        if missing:
            return (
                f"worker {worker}'s loader did not show where {len(missing)} tensor(s) land, "
                f"e.g. {missing[:3]} (loaded into several parameters, or converted on the way)"
            )
    return None


class PointToPointPath:
    """Which engines take the point-to-point path (rank 0 knows), the plan, and each sync
    into them. `sync` is called on every rank at once; `consider` and `takes` on rank 0."""

    def __init__(
        self,
        source: DTensorV2Source,
        group: SyncGroup,
        *,
        log: logging.LoggerAdapter,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        self.source = source
        self.group = group
        self.log = log
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.pieces = ShardPieces(source, rank=group.rank)
        self._ready: list[str] = []  # rank 0: engines whose placements allow a plan
        self._no: dict[str, str] = {}  # rank 0: engine -> why it keeps buckets
        self._key: tuple | None = None  # rank 0: the engines (and worker counts) planned for
        # rank 0: each engine's workers in the plan (first, count), each worker's tensor ->
        # the parameter it lands in
        self._workers: dict[str, tuple[int, int]] = {}
        self._params: list[dict[str, str]] = []
        self.sender: PointToPointSender | None = None
        self.plan: TransferPlan | None = None
        self.num_planned = 0
        self._failures = 0  # rank 0: point-to-point syncs failed in a row

    def takes(self, name: str) -> bool:
        """Rank 0: whether engine `name`'s next sync is point to point."""
        return name in self._ready

    def consider(self, sender: WeightSender, names: list[str]) -> None:
        """Rank 0, after a sync by buckets: engines whose workers' placements are known for
        every tensor take the point-to-point path from the next sync on."""
        for name in names:
            if name in self._ready or name in self._no:
                continue
            why = why_not(sender.engines[name], sender.specs)
            if why is None:
                self._ready.append(name)
                self.log.info("engine %r: the next syncs go point to point", name)
            else:
                self._no[name] = why
                self.log.info("point_to_point off for engine %r, it keeps buckets: %s", name, why)

    def _holdings(self) -> list[tuple[str, int, int]]:
        """(tensor, first element, end) of every piece this rank holds."""
        listed = self.pieces.listed()
        if listed is None:
            raise RuntimeError(unsendable(self.source, self.group.rank))
        out = []
        for name, src, offset in listed:
            if src is not None:
                start = offset // src.element_size()
                out.append((name, start, start + src.numel()))
        return out

    def _shards(self) -> dict[str, tuple[int, torch.Tensor]]:
        """{tensor: (first element, this rank's elements, flat)}: what `send` reads."""
        listed = self.pieces.listed()
        if listed is None:
            raise RuntimeError(unsendable(self.source, self.group.rank))
        return {
            name: (offset // src.element_size(), src.reshape(-1))
            for name, src, offset in listed
            if src is not None
        }

    def _open(self, sender: WeightSender, names: list[str]) -> list[str]:
        """Rank 0 (the other ranks in `_follow_open`): the plan for `names`, made when the
        engines changed; every engine's workers join it. Returns the engines that refused
        (then nobody took the plan, and this sync goes by buckets)."""
        key = tuple((n, len(sender.engines[n].placements or [])) for n in names)
        replan = key != self._key or self.sender is None
        self.group.broadcast({"replan": replan})
        if not replan:
            return []
        held = self.group.gather(self._holdings()) or []
        holdings: dict[str, list[tuple[int, int, int]]] = {}
        for rank, pieces in enumerate(held):
            for name, start, stop in pieces:
                holdings.setdefault(name, []).append((rank, start, stop))
        workers: list[dict[str, Any]] = []
        first: dict[str, int] = {}
        for name in names:
            first[name] = len(workers)
            workers.extend(p or {} for p in sender.engines[name].placements or [])
        start = time.perf_counter()
        self.close()
        p2p: PointToPointSender | None = None
        try:
            plan = plan_transfers(
                {s.name: element_size(s.dtype) for s in sender.specs},
                holdings,
                workers,
                num_ranks=self.group.world_size,
            )
            p2p = PointToPointSender(
                plan, 0, host=self.host, backend=self.backend, timeout_s=self.timeout_s
            )
            plan_dict = plan.to_dict()
            answers = sender.calls.wait_all(
                [
                    sender.calls.submit(
                        n,
                        "p2p_open",
                        plan_dict,
                        first[n],
                        self.host,
                        p2p.port,
                        self.backend,
                        self.timeout_s,
                    )
                    for n in names
                ]
            )
        except BaseException as exc:
            if p2p is not None:
                p2p.close()
            self.group.broadcast({"plan": None, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            raise
        refused: dict[str, str] = {}
        for name, answer in zip(names, answers):
            if answer.get("why"):
                refused[name] = answer["why"]
        if refused:
            p2p.close()
            self.group.broadcast({"plan": None})
            for name, why in refused.items():
                self._ready.remove(name)
                self._no[name] = why
                self.log.info("point_to_point off for engine %r, it keeps buckets: %s", name, why)
            return list(refused)
        self.group.broadcast({"plan": plan_dict, "port": p2p.port})
        self.sender, self.plan, self._key = p2p, plan, key
        self._workers = {n: (first[n], len(sender.engines[n].placements or [])) for n in names}
        self._params = [{t: placed[0] for t, placed in w.items()} for w in workers]
        self.num_planned += 1
        self.log.info(
            "point-to-point plan for %s: %d links, made in %.3f s",
            names,
            len(plan.moves),
            time.perf_counter() - start,
        )
        return []

    def _follow_open(self) -> None:
        """Every rank but 0: its part of `_open`."""
        if not self.group.broadcast()["replan"]:
            return
        self.group.gather(self._holdings())
        msg = self.group.broadcast()
        self.close()
        if msg.get("error"):
            raise RuntimeError(f"rank 0 failed to plan this sync: {msg['error']}")
        if msg["plan"] is None:
            return
        self.plan = TransferPlan.from_dict(msg["plan"])
        self.sender = PointToPointSender(
            self.plan,
            self.group.rank,
            host=self.host,
            port=msg["port"],
            backend=self.backend,
            timeout_s=self.timeout_s,
        )

    def _send(self, verify: bool) -> dict[str, Any]:
        """This rank's pieces to every worker the plan links it with: {"bytes", "seconds",
        and with `verify` "prints": each piece's fingerprint contribution,
        `PointToPointSender.sent_prints`}, or {"error"} (every rank still takes part in the
        gather that follows)."""
        try:
            if self.sender is None:
                raise RuntimeError("point-to-point send without a plan")
            start = time.perf_counter()
            sent = self.sender.send(self._shards())
            seconds = time.perf_counter() - start
            prints = self.sender.sent_prints() if verify else None
        except Exception as exc:
            return {"error": f"rank {self.group.rank}: {type(exc).__name__}: {exc}"[:2000]}
        return {"bytes": sum(sent.values()), "seconds": seconds, "prints": prints}

    def _expected(self, everyone: list[list]) -> dict[str, list[dict[str, Fingerprint]]]:
        """Rank 0: each engine's workers' expected fingerprints, combined from every rank's
        contributions (each rank hashed the pieces it sent)."""
        # Every parameter a worker's tensors land in, an empty tensor's too (it contributes
        # nothing: its parameter must fingerprint to zero words).
        parts: list[dict[str, list[Fingerprint]]] = [
            {p: [] for p in params.values()} for params in self._params
        ]
        for contributions in everyone:
            for worker, tensor, fp in contributions:
                parts[worker].setdefault(self._params[worker][tensor], []).append(fp)
        return {
            name: [
                {p: combine(fps) for p, fps in parts[w].items()}
                for w in range(first, first + count)
            ]
            for name, (first, count) in self._workers.items()
        }

    def sync(
        self,
        sender: WeightSender | None,
        version: str,
        names: list[str],
        *,
        verify: bool,
        probe: dict[str, dict] | None = None,
        peers: SyncPeers | None = None,
    ) -> tuple[SyncReport | None, list[str]]:
        """Every rank sends its own pieces to the engines' workers (`sender`: rank 0's).
        Returns rank 0's report and the engines to sync by buckets instead (they refused the
        plan). Once they sent, the other ranks wait for rank 0's done or error (`peers`,
        `TrainerSync._follow_checks`): a send that failed on any rank fails the sync there."""
        if self.group.rank != 0:
            self._follow_open()
            go = self.group.broadcast()
            if go.get("error"):
                raise RuntimeError(f"rank 0 failed this sync before sending: {go['error']}")
            if go["send"]:  # a failed send is reported to rank 0, which fails the sync
                self.group.gather(self._send(verify))
            return None, go["fallback"]
        if sender is None:
            raise RuntimeError("rank 0 has no sender for a sync: connect({name: engine}) first")
        try:
            refused = self._open(sender, names)
        except BaseException as exc:
            self._failed(names, exc)
            raise
        if refused:
            self.group.broadcast({"send": False, "fallback": names})
            return None, names

        def send(go: bool) -> dict[str, Any]:
            if not go:  # no engine began: rank 0 raises, and so do the others
                self.group.broadcast({"send": False, "fallback": [], "error": "begin failed"})
                return {}
            self.group.broadcast({"send": True, "fallback": []})
            everyone = self.group.gather(self._send(verify)) or []
            if peers is not None:  # every rank is done sending and waits for rank 0's word
                peers.filled()
            errors = [e["error"] for e in everyone if "error" in e]
            if errors:
                raise RuntimeError(f"point-to-point send failed: {'; '.join(errors)}")
            out: dict[str, Any] = {
                "bytes": [e["bytes"] for e in everyone],
                "send_s": [e["seconds"] for e in everyone],
            }
            if verify:
                out["worker_sent"] = self._expected([e["prints"] or [] for e in everyone])
            return out

        try:
            report = sender.sync_p2p(
                send, version=version, engines=names, verify=verify, probe=probe, peers=peers
            )
        except BaseException as exc:
            self._failed(names, exc)
            raise
        self._failures = 0
        return report, []

    def _failed(self, names: list[str], exc: BaseException) -> None:
        """Rank 0, after a point-to-point sync of `names` failed: the next one plans and joins
        again; after `MAX_FAILURES` failures in a row these engines keep buckets (what failed
        may fail every time: a store the engines cannot reach, a plan that cannot be made)."""
        self._key = None
        self._failures += 1
        if self._failures < MAX_FAILURES:
            return
        why = f"{self._failures} point-to-point syncs failed in a row, the last: {exc}"[:500]
        for name in names:
            if name in self._ready:
                self._ready.remove(name)
                self._no[name] = why
                self.log.warning(
                    "point_to_point off for engine %r, it keeps buckets: %s", name, why
                )
        self._failures = 0

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.plan = None
