"""The trainer side of the one-copy path (weightsync/trainer/one_copy/targets.py), one per trainer rank.

After an engine's first sync by buckets, rank 0 asks it to share its parameters; from the next
sync on every rank writes its own shards straight into them (`OneCopyWriter`), and the sender
runs begin/end around the writes (`WeightSender.sync_one_copy`). An engine whose parameters moved
takes buckets for that sync and is asked to share again after it; one that cannot share is
asked no more.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from weightsync.trainer.one_copy.writer import OneCopyWriter, worker_shares
from weightsync.trainer.source import DTensorV2Source
from weightsync.trainer.sync_group import SyncGroup
from weightsync.wire.protocol import ShareAnswer, SyncReport

if TYPE_CHECKING:
    from weightsync.trainer.sender import WeightSender


def unreachable(
    shared: dict[str, Any] | list, transport: str, rank_gpus: list[str | None]
) -> str | None:
    """Why trainer ranks on `rank_gpus` (each rank's GPU UUID, None: on the CPU) syncing over
    `transport` cannot write into what an engine shared (None: they can)."""
    for worker in worker_shares(shared):
        if "cuda" not in worker:
            if transport != "shm":
                return (
                    f"the engine shares CPU parameters; with transport {transport!r} the "
                    f"one-copy path takes GPU engines only"
                )
            continue
        if transport != "cuda_ipc":
            return (
                f"the engine's parameters are on a GPU; with transport {transport!r} the "
                f"one-copy path takes CPU engines only"
            )
        gpu = worker["cuda"].get("uuid")
        if not rank_gpus or any(g != gpu for g in rank_gpus):
            return (
                f"the engine's parameters are on GPU {gpu}, the trainer ranks' shards on "
                f"{sorted(set(map(str, rank_gpus)))}: the GPU one-copy path writes within "
                f"one GPU only"
            )
    return None


class OneCopyPath:
    """Which engines share their parameters (rank 0 knows), and each sync into them. Every
    method but `share` and `takes` is called on every rank at once."""

    def __init__(
        self,
        source: DTensorV2Source,
        group: SyncGroup,
        *,
        log: logging.LoggerAdapter,
        transport: str = "shm",
        rank_gpus: list[str | None] | None = None,
    ) -> None:
        """`transport`: "shm" takes engines sharing a shared-memory segment (CPU parameters),
        "cuda_ipc" engines exporting CUDA storages on the GPU every rank's shards are on
        (`rank_gpus`: each rank's GPU UUID, None for a rank on the CPU; rank 0)."""
        self.group = group
        self.transport = transport
        self.rank_gpus = rank_gpus or []
        self.log = log
        self.writer = OneCopyWriter(source, group)
        # rank 0: engine -> its shared parameters (one description per worker at TP > 1)
        self._shared: dict[str, dict[str, Any] | list[dict[str, Any]]] = {}
        self._no_share: dict[str, str] = {}  # rank 0: engine -> why it has no one-copy path
        self._sent: dict[str, list[str]] = {}  # rank 0: engine -> segments the ranks know of

    def takes(self, name: str) -> bool:
        """Rank 0: whether engine `name` shares its parameters (its next sync is one-copy)."""
        return name in self._shared

    def share(self, sender: WeightSender, names: list[str], report: SyncReport) -> SyncReport:
        """Rank 0, after a sync by buckets: engines that can, share their parameters; the
        report with how long that took each."""
        engines = dict(report.engines)
        for name in names:
            if name in self._shared or name in self._no_share:
                continue
            start = time.perf_counter()
            try:
                answer: ShareAnswer = sender.call(name, "share_params")
            except Exception as exc:  # an engine without the path, or one that failed
                answer = ShareAnswer(shared=None, why=f"{type(exc).__name__}: {exc}")
            if answer.shared and (
                why := unreachable(answer.shared, self.transport, self.rank_gpus)
            ):
                answer = ShareAnswer(shared=None, why=why)
            if answer.shared:
                self._shared[name] = answer.shared
                engines[name] = replace(engines[name], share_s=time.perf_counter() - start)
                self.log.info(
                    "engine %r shares its parameters (%.2f s): the next syncs write into them",
                    name,
                    engines[name].share_s,
                )
            elif not answer.retry:
                self._no_share[name] = answer.why or "unknown"
                self.log.info(
                    "one_copy off for engine %r, it keeps taking buckets: %s", name, answer.why
                )
        return replace(report, engines=engines)

    def sync(
        self,
        sender: WeightSender | None,
        version: str,
        names: list[str],
        *,
        verify: bool,
        probe: dict[str, dict] | None = None,
    ) -> tuple[SyncReport | None, list[str]]:
        """Every rank writes its own shards into the engines' shared parameters (`sender`:
        rank 0's). Returns rank 0's report and the engines to sync by buckets instead."""
        if self.group.rank != 0:
            msg = self.group.broadcast()
            self.writer.write(msg, verify=verify)
            return None, msg["fallback"]
        if sender is None:
            raise RuntimeError(
                "rank 0 has no sender for a one-copy sync: connect({name: engine}) first"
            )

        def sharings(n: str) -> list[str]:  # the tokens of an engine's workers' sharings
            return [s["token"] for s in worker_shares(self._shared[n])]

        def write(one_copy: list[str], fallback: list[str]) -> dict[str, Any] | None:
            new = {n: self._shared[n] for n in one_copy if self._sent.get(n) != sharings(n)}
            self.group.broadcast({"one_copy": one_copy, "fallback": fallback, "new": new})
            for n in new:
                self._sent[n] = sharings(n)
            for n in fallback:  # its parameters moved: buckets now, then share again
                self._shared.pop(n, None)
                self._sent.pop(n, None)
            return self.writer.write(
                {"one_copy": one_copy, "new": new, "fallback": fallback}, verify=verify
            )

        # Each engine is asked to confirm the sharing the ranks map (or map in this sync's
        # write): one shared again since (its parameters moved or were fenced off, e.g. by
        # another trainer's update) goes by buckets, then its new sharing is mapped.
        report, fallback = sender.sync_one_copy(
            write,
            version=version,
            engines=names,
            verify=verify,
            sharing={n: sharings(n) for n in names if n in self._shared},
            probe=probe,
        )
        if report is not None:
            report = replace(
                report,
                phases_s={**(report.phases_s or {}), "rank_write": self.writer.rank_write_s},
            )
        return report, fallback

    def close(self) -> None:
        self.writer.close()
