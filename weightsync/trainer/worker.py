"""`WeightSyncWorker`: what a driver, or a training framework's Ray code, calls on every trainer
rank to keep engines in step.

A trainer rank that lives in a Ray actor (one per rank: weightsync's `DTensorV2WeightSyncWorker`
and its engine-env subclasses, or a framework's own policy worker) holds a `TrainerSync` beside
its model. The driver reaches it only through Ray calls, which may cross from one environment
into another (the SGLang worker runs in the sglang env, the driver in its own), so every answer
is plain data: `TrainerSync`'s typed results as their `to_dict()`, which the driver reads back
with `SyncReport.from_dict` / `VerifyReport.from_dict` (`launch.launcher.TrainerGroup.sync` and
`.verify` do).

Every method is called on every rank at once, with the same arguments (gathering a DTensor is a
collective: a rank left out makes the others wait until the sync's timeout); rank 0 answers for
the group and the other ranks answer None. In this order:

    refit_info()                 any time after construction
    connect({name: engine})      before the first sync; again to add engines
    sync(version) / verify()     after connect, as often as the training loop wants
    shutdown()                   last
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class WeightSyncWorker(ABC):
    """One trainer rank, as the driver sees it: the weight-sync calls, answered as plain data.

    Built on every rank, after the rank's process group and model; an implementation builds its
    `TrainerSync` in its constructor."""

    @abstractmethod
    def refit_info(self) -> list[dict[str, Any]]:
        """[{name, dtype, shape, nbytes}] in send order: what every sync sends. Every rank,
        any time after construction; each rank answers the same."""

    @abstractmethod
    def connect(self, engines: dict[str, Any]) -> dict[str, Any] | None:
        """Register engines {name: engine actor handle} and check refit info with each: nothing
        is written to an engine before every check passed. Every rank at once, before the
        first sync (again later to add engines); only rank 0's `engines` are used. Rank 0
        answers {name: {"num_params", "num_receivers"}}, the other ranks None."""

    @abstractmethod
    def sync(
        self,
        version: str | None = None,
        *,
        verify: bool | None = None,
        engines: list[str] | None = None,
    ) -> dict[str, Any] | None:
        """Deliver the model's current weights to `engines` (default: all connected) as
        `version`. Every rank at once, after `connect`. Rank 0 answers the `SyncReport` as plain
        data (`to_dict()`: {"version", "path", "nbytes", "sync_s", "gbps", "engines", ...,
        "verify" when verified}), the other ranks None; a failed sync raises on every rank."""

    @abstractmethod
    def verify(self, engines: list[str] | None = None) -> dict[str, Any] | None:
        """Compare each engine's parameters with the model's current weights, without syncing.
        Every rank at once, after `connect`. Rank 0 answers the `VerifyReport` as plain data
        ({engine: {"verified", "mismatched", "num_checked", ...}, "verify_s"}), the other
        ranks None."""

    @abstractmethod
    def shutdown(self) -> None:
        """Free the weight sync (transport, mapped segments, sync group) and what else the
        worker holds. Every rank at once, last: no other call may follow."""
