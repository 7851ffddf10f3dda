"""What an engine actor offers the trainer, and the update-session rules every engine follows.

`WeightReceiver` is the interface an engine actor offers the trainer (plain data in and out: each
answer is one of weightsync/wire/protocol.py's classes, as its `to_dict()`);
`EngineSession` holds the update-session rules every engine actor follows around its own hooks.
What runs next to the engine's model is weightsync/engine/replica.py (`ModelReceiver`); the
reference receiver for a plain torch module is weightsync/engine/module_receiver.py.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from weightsync.wire.errors import BucketRejected, EngineBusy, ProbeFailed
from weightsync.wire.fingerprint import same_prints
from weightsync.wire.probe import Decoded, ProbeRequest, check_probe
from weightsync.wire.protocol import (
    BeginAnswer,
    EndReport,
    LoadReport,
    SettleReport,
    ShareAnswer,
    StageReport,
    without_known,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

logger = logging.getLogger(__name__)


class WeightReceiver(ABC):
    """What an engine actor offers the trainer. Every argument and result is plain data.

    Called by the trainer's sending rank only (rank 0 of the trainer group), in this order:
      1. `check_refit(specs)` once per trainer, before any sync; nothing is written.
      2. per sync: `begin(version)`, then `load_bucket(descriptor)` for every bucket in order,
         then, when the sync is verified, `stage(version)`, then `end(version)`;
         `abort(reason)` instead of `end` when the sender failed or verification did.
      3. `fingerprints()` / `worker_fingerprints()` whenever the trainer verifies outside a sync.
    `weight_version()` may be called at any time.
    These methods are where answers go on the wire: each builds its weightsync/wire/protocol.py
    answer and returns its `to_dict()`.
    """

    @abstractmethod
    def check_refit(self, specs: list[dict], accept: dict[str, str] | None = None) -> dict:
        """Validate the trainer's tensors against the engine's parameters: a `RefitAnswer`.

        Raises ValueError naming the first tensor whose name, shape or dtype the engine rejects,
        or a form it derives after loading that a sync cannot keep in step, unless `accept`
        ({kind: reason}, `SyncOptions.accept_unkept`) names its kind.
        """

    @abstractmethod
    def begin(
        self,
        version: str,
        one_copy: bool | list[str] = False,
        owner: str | None = None,
        staged: bool = False,
    ) -> dict:
        """Open an update session (the engine stops taking new requests until `end`): a
        `BeginAnswer`. `owner` names the trainer (its sender) that opens it: while its update
        is open, another owner's `begin` is refused until the update ends or expires.

        With `staged` (an engine whose `staged_support()` is None) the engine goes on serving
        its current weights while the update is loaded into a second copy of its parameters
        (buckets only, not `one_copy`), and `end` switches to that copy in one short pause; an
        `abort` leaves the served weights as they were.

        With `one_copy` the trainer will write into the shared parameters (weightsync/trainer/one_copy/targets.py)
        instead of sending buckets; the answer says `one_copy=False` and why, without opening
        anything, when the parameters are not (or no longer) shared. `one_copy` as a list names
        the sharings the trainer holds mapped (each worker's segment name or CUDA export owner,
        `sharing_of`): a worker whose parameters are shared otherwise now answers why not."""

    @abstractmethod
    def load_bucket(self, descriptor: dict) -> dict:
        """Load one bucket's tensors: a `LoadReport`. A descriptor naming another update
        (`"update"`, the version its sender opened) is refused before anything is read."""

    @abstractmethod
    def end(
        self,
        version: str,
        probe: dict | None = None,
        known: dict | None = None,
        switch_at: float | None = None,
    ) -> dict:
        """Finish: post-process the weights, reset the prefix cache, adopt `version`: an
        `EndReport`. With `probe` (weightsync/wire/probe.py `ProbeRequest.to_dict()`), first
        score its tokens with the engine's forward on the staged weights and refuse to adopt
        them (`ProbeFailed`; the update stays open for the sender's abort) when the scores are
        too far from the trainer's. `known`: how much of the engine's placements the sender
        already holds (weightsync/wire/protocol.py `known_maps`): left out of the report when
        it holds them whole. `switch_at` (a staged update; `time.time()` seconds): the
        instant the sender named for every engine's switch; the engine serves on until then
        (at once when it has passed)."""

    @abstractmethod
    def abort(self, reason: str, owner: str | None = None) -> None:
        """Close a session that failed; the engine keeps its previous version tag. An `owner`
        other than the open update's closes nothing (a trainer gone silent cannot abort the
        update of the trainer that followed it)."""

    @abstractmethod
    def fingerprints(self) -> dict[str, list[int]]:
        """{engine parameter name: [s, h1, h2]} of the weights the engine holds now
        (weightsync/wire/fingerprint.py)."""

    def stage(self, version: str, expect: list[str] | None = None) -> dict:
        """Inside the open update `version`, after its last bucket: what it holds, for
        verification before the engine adopts it: a `StageReport`. This default reports
        `fingerprints()` without placements (checked by name). `expect`: the digest the
        trainer expects of each worker's fingerprints; where they match, the answer says so
        (`same`) in place of the fingerprints."""
        return _staged_answer(StageReport(fingerprints=[self.fingerprints()]), expect)

    @abstractmethod
    def weight_version(self) -> str | None:
        """The version tag of the weights served now (None before the first sync)."""

    def settle(self, timeout_s: float = 120.0) -> dict:
        """Wait for work the engine finishes in the background after an update (none by
        default): a `SettleReport`."""
        return SettleReport().to_dict()

    def staged_support(self) -> str | None:
        """Why this engine cannot take staged updates (`begin(..., staged=True)`), or None
        when it can. Asked at connect by a trainer that stages (`SyncOptions.staged`)."""
        return f"{type(self).__name__} has no staged updates"

    def share_params(self) -> dict:
        """Move the parameters into shared memory for the one-copy path, after a first sync:
        a `ShareAnswer`."""
        return ShareAnswer(shared=None, why=f"{type(self).__name__} has no one-copy path").to_dict()

    def p2p_support(self) -> str | None:
        """Why this engine cannot take the point-to-point path (weightsync/transports/p2p.py),
        or None when it can. Asked at connect by a trainer that syncs point to point."""
        return f"{type(self).__name__} has no point-to-point receiver"

    def p2p_open(
        self,
        plan: dict,
        first_worker: int,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> dict:
        """Join a transfer plan's group (weightsync/wire/transfer_plan.py): the engine's
        workers are the plan's workers `first_worker`, `first_worker + 1`, ... in worker (TP
        rank) order, the group's store at `host:port`. Nothing is written. Answers {"why":
        None}, or {"why": ...} saying why the engine cannot take this plan (then it joined
        nothing)."""
        return {"why": self.p2p_support()}

    def p2p_receive(self, version: str) -> dict:
        """Inside the open update `version`, instead of buckets: every worker receives its
        pieces from the trainer ranks the plan links it with, at the same time as they send,
        and writes each in place: a `LoadReport`."""
        raise NotImplementedError(self.p2p_support())


class NothingSwitched(RuntimeError):
    """A staged update's switch (or a revert) stopped before any parameter was written."""


class EngineSession(WeightReceiver):
    """The update-session rules every engine actor follows, around engine-specific hooks.

    One update is open at a time, and it belongs to the sender that opened it (`owner`):
    another sender's `begin` is refused (`EngineBusy`), its buckets (`"update"` naming another
    version) and its `abort` touch nothing, while the same sender's `begin` takes its own
    unfinished update over. An update whose sender has made no call for `idle_timeout_s`
    (checked whenever the engine is asked to begin, serve or report its version) is aborted:
    nothing waits on a sender that is gone. An update aborted once weights may be mixed leaves
    the engine refusing requests (`check_serving`) until a later sync completes, unless the
    engine kept and put back its previous weights (`keep_previous=True`): then it goes on
    serving the previous version. Subclasses implement `_engine_begin`, `_engine_load`,
    `_engine_end` (its report; the session adds the timings) and `_engine_abort` (returns
    whether weights may now be mixed: true once a bucket was loaded, unless the engine put its
    previous weights back). The public methods own these rules and put the answers on the wire.

    Generation is paused while parameters are written or probed: from `begin` until `end` or
    `abort` (idle expiry included; a failed `end` stays paused until then), and around
    `share_params` (which wraps the hook `_engine_share`). `_pause` and `_resume` are the
    hooks; an in-process engine keeps them no-ops, since its actor runs one call at a time and
    its own `generate` refuses during an update, but an engine's HTTP server also serves
    clients that call it directly. Whatever closes the update resumes (`abort` in a `finally`),
    so no error leaves the engine paused once its update is closed. While paused, a watchdog
    expires an update whose sender went silent (`GenerationPause`).

    A staged update (`begin(..., staged=True)`, engines whose `staged_support()` is None) does
    not pause: the engine serves its current weights, and the hooks load into a second copy
    (`_into_copy` is true while it is open); `_engine_end` switches to it in the engine's own
    short pause and reports when (`EndReport.switched_at`, `pause_s`); `_engine_abort` drops
    it, the served weights untouched.
    """

    engine_name = "engine"

    def __init__(self, *, idle_timeout_s: float = 60.0) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s}: must be positive")
        self.idle_timeout_s = idle_timeout_s
        self._version: str | None = None
        self._open: str | None = None
        self._owner: str | None = None  # who opened `_open` (its sender's name)
        self._last_owner: str | None = None  # who opened the last update that opened
        self._loaded = 0
        self._broken: str | None = None
        self._begin_t = 0.0
        self._last_call = 0.0
        self._one_copy = False
        self._into_copy = False  # the open update loads into a second copy (`begin`'s `staged`)
        # The open staged update's switch was asked for: the served weights may have changed.
        self._switching = False
        self._prepared = False  # the open staged update's switch was made ready (`end`)
        # (the version `revert` goes back to,): set by a staged update whose switch swapped
        # (`_engine_swaps`), cleared by the next update or revert. (None,): the weights the
        # engine started with.
        self._revert_to: tuple[str | None] | None = None
        self._holds_copy = False  # a staged update made the staged copy; one not staged frees it
        # Taken by every method that changes the session, as the watchdog thread calls `abort`.
        self._lock = threading.RLock()
        self._pausing = GenerationPause(self)

    def _pause(self) -> bool:
        """Stop the engine generating before its parameters are written or probed; whether it
        paused (then `_resume` follows). Requests that arrive meanwhile must wait or fail,
        never decode on weights of two versions."""
        return False

    def _resume(self) -> None:
        """Undo `_pause`."""

    def _engine_share(self) -> dict:
        return super().share_params()

    @abstractmethod
    def _engine_begin(self, one_copy: bool | list[str]) -> str | None:
        """Open the engine's side of an update; with `one_copy`, return why the trainer cannot
        write into the parameters (then nothing is left open), or None. A list `one_copy` names
        the sharings the trainer writes into (`sharing_of`: each worker checks its own is one
        of them)."""

    @abstractmethod
    def _engine_load(self, descriptor: dict) -> LoadReport: ...

    @abstractmethod
    def _engine_end(self, version: str) -> EndReport: ...

    @abstractmethod
    def _engine_abort(self, reason: str) -> bool: ...

    def _engine_stage(self) -> StageReport:
        return StageReport(fingerprints=[self.fingerprints()])

    def _engine_prepare(self) -> None:
        """A staged update's switch made ready before the engine's pause (its batched copies
        planned), where `_engine_stage` (a verified update's) did not already: `end` calls it
        before it waits for the named instant and switches. Nothing by default."""

    def _engine_swaps(self) -> bool:
        """Whether a staged update's switch keeps the weights it replaces (then `revert` can
        put them back until the next update)."""
        return False

    def _engine_revert(self, version: str) -> EndReport:
        """Put back, in one short pause, the weights the last switch replaced, tagged
        `version`."""
        raise NotImplementedError(f"{type(self).__name__} cannot revert a switch")

    def _engine_probe(self, tokens: list[list[int]]) -> list[list[float]]:
        """Inside the open update, after its last write and before `_engine_end`: per prompt,
        the engine's log-probability of each token after the first given the ones before it,
        from its own forward on the staged weights (every tensor-parallel worker taking part),
        the update still able to roll back. Its answers must not outlive a rollback (an engine
        that caches the probe's KV drops it at `_engine_abort`)."""
        raise NotImplementedError(self.probe_support())

    def _engine_probe_decode(self, tokens: list[list[int]], steps: int) -> list[Decoded]:
        """After `_engine_probe`, in the same open update: per prompt, `steps` tokens the
        engine decodes greedily on the staged weights (its decode path: KV cache, incremental
        attention, tensors derived for decode), with their log-probs and its `DECODE_TOP` most
        likely at each step."""
        raise NotImplementedError(self.probe_support(True))

    def probe_support(self, decode: bool = False) -> str | None:
        """Why this engine cannot score a probe (weightsync/wire/probe.py), its greedy decode
        steps too with `decode`, or None when it can. Asked at connect by a trainer that
        probes, so an engine that cannot is refused there."""
        if type(self)._engine_probe is EngineSession._engine_probe:
            return f"{type(self).__name__} has no forward to score a probe with"
        if decode and type(self)._engine_probe_decode is EngineSession._engine_probe_decode:
            return f"{type(self).__name__} cannot decode a probe's steps"
        return None

    def begin(
        self,
        version: str,
        one_copy: bool | list[str] = False,
        owner: str | None = None,
        staged: bool = False,
    ) -> dict:
        if staged and one_copy:
            raise ValueError(
                f"{self.engine_name}: begin({version!r}) staged and one_copy: a staged update "
                f"goes by buckets; begin it with one_copy=False"
            )
        if staged and (why := self.staged_support()) is not None:
            raise ValueError(f"{self.engine_name}: begin({version!r}) staged: {why}")
        with self._lock:
            self._expire_idle()
            if self._open is not None and owner != self._owner:
                # Another trainer's update: refused, not taken over, until it ends or expires.
                idle = time.perf_counter() - self._last_call
                raise EngineBusy(
                    f"{self.engine_name}: update {self._open!r} of another trainer "
                    f"({self._owner or 'unnamed'}) is open, its last call {idle:.0f} s ago; "
                    f"{version!r} is refused until it ends or goes {self.idle_timeout_s:g} s "
                    f"without a call (idle_timeout_s). Only one trainer drives an engine."
                )
            if self._open is not None:
                # The same trainer again: its earlier update failed without an abort reaching us.
                self.abort(f"update {self._open!r} never ended; a new update {version!r} began")
            self._loaded = 0
            self._begin_t = self._last_call = time.perf_counter()
            self._into_copy, self._switching, self._prepared = staged, False, False
            self._revert_to = None  # this update may write what a revert would put back
            if not staged and self._holds_copy:
                self._release_unstaged(version)
            self._holds_copy = self._holds_copy or staged
            if not staged:  # a staged update serves on until `_engine_end` switches
                self._pause_generation()
            try:
                why = self._engine_begin(one_copy)
            except BaseException:
                self._resume_generation()
                raise
            # The receivers keep the views of the last trainer's buckets only (transports/):
            # another trainer's update in between, and that trainer's "same" would be refused.
            replays = owner is not None and owner == self._last_owner
            if why is not None:
                self._resume_generation()
                return BeginAnswer(one_copy=False, why=why, replays=replays).to_dict()
            self._open, self._one_copy, self._owner = version, bool(one_copy), owner
            self._last_owner = owner
            if one_copy:
                self._loaded = 1  # the trainer writes into the parameters from now on
            return BeginAnswer(one_copy=bool(one_copy), replays=replays).to_dict()

    def load_bucket(self, descriptor: dict) -> dict:
        with self._lock:
            if self._open is None:
                raise RuntimeError(
                    f"{self.engine_name}: load_bucket outside an update; call begin first"
                )
            update = descriptor.get("update")
            if update is not None and update != self._open:
                raise BucketRejected(
                    f"{self.engine_name}: a bucket of update {update!r} arrived while update "
                    f"{self._open!r} is open; refused, nothing of it was read"
                )
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
            return result.to_dict()

    def stage(self, version: str, expect: list[str] | None = None) -> dict:
        """Still paused: what the open update holds (`_engine_stage`); `expect` as
        `WeightReceiver.stage`'s."""
        with self._lock:
            if self._open != version:
                raise RuntimeError(
                    f"{self.engine_name}: stage({version!r}) but the open update is {self._open!r}"
                )
            self._last_call = time.perf_counter()
            try:
                report = _staged_answer(self._engine_stage(), expect)
                self._prepared = self._into_copy  # a staged engine readies its switch there
                return report
            finally:
                self._last_call = time.perf_counter()

    def end(
        self,
        version: str,
        probe: dict | None = None,
        known: dict | None = None,
        switch_at: float | None = None,
    ) -> dict:
        with self._lock:
            if self._open != version:
                raise RuntimeError(
                    f"{self.engine_name}: end({version!r}) but the open update is {self._open!r}"
                )
            start = time.perf_counter()
            # A failed end leaves the update open, and so paused: the sender's `abort` (or the
            # idle expiry) resumes, once the engine's weights are whole or it refuses to serve.
            # The probe scores the staged weights before the engine finishes the update (and
            # drops what it kept of the previous weights): a failed probe is rolled back. A
            # staged update's forward serves the current weights until its switch: it is
            # probed just after, generation held (`_probe_switched`).
            probed = None if probe is None or self._into_copy else self._probe(version, probe)
            if self._into_copy and not self._prepared:  # not inside the pause, nor late
                self._engine_prepare()
                self._prepared = True
            at = float(switch_at) if switch_at is not None and self._into_copy else None
            if at is not None:  # serving on until the instant
                wait_until(at)
            if probe is not None and self._into_copy:
                self._pause_generation()  # a server's new requests held, those in flight done
            report = self._engine_end(version)
            if probe is not None and self._into_copy:
                probed = self._probe_switched(version, probe)
            if at is not None:
                report = replace(report, switch_at=at)
            if probed is not None:
                report = replace(report, probe=probed)
            swapped = self._into_copy and self._engine_swaps()
            self._revert_to = (self._version,) if swapped else None
            broken, self._open, self._broken = self._broken, None, None
            self._version = version
            self._resume_generation()
            if broken:  # its server refused its clients (a staged sync paused nothing)
                self._server_serves(refuse=None)
            if known:
                report = without_known(report, known)
            return replace(
                report,
                end_s=time.perf_counter() - start,
                session_s=time.perf_counter() - self._begin_t,
            ).to_dict()

    def _probe_switched(self, version: str, probe: dict) -> dict:
        """A staged update just switched in, generation still held (`end`): the probe scored
        on the weights now served. When it fails, the update ends here: an engine whose switch
        kept the previous weights (a swap) is switched back to them and serves on; one whose
        switch copied them over refuses to serve until a sync completes. Either way the
        error is raised and no client was answered by the failed weights."""
        try:
            return self._probe(version, probe)
        except Exception as exc:
            previous, why = self._version, None
            if self._engine_swaps():
                try:
                    self._engine_revert(previous or "")
                except Exception as revert_exc:  # noqa: BLE001 - reported in the state below
                    why = f"switching back to {previous!r} failed too ({revert_exc})"
            else:
                why = "its switch did not keep the previous weights (keep_previous=False)"
            self._open, self._revert_to, self._switching = None, None, False
            if why is not None:
                self._broken = f"update {version!r} failed its probe after its switch; {why}"
            self._resume_generation()  # a server refuses its clients too, when broken
            done = f"it serves {previous!r} again" if why is None else f"it refuses to serve: {why}"
            kind = type(exc) if type(exc) in (ProbeFailed, ValueError) else RuntimeError
            raise kind(f"{exc} (a staged update, probed after its switch: {done})") from exc

    def _probe(self, version: str, probe: dict) -> dict:
        """Score the probe on the staged weights; `ProbeFailed` when too far off."""
        request = ProbeRequest.from_dict(probe)
        self._last_call = start = time.perf_counter()
        try:
            got = self._engine_probe(request.tokens)
            decoded = (
                self._engine_probe_decode(request.tokens, request.decode_steps)
                if request.decode_steps
                else []
            )
        finally:
            self._last_call = time.perf_counter()
        checked = check_probe(
            request,
            got,
            engine=self.engine_name,
            version=version,
            probe_s=time.perf_counter() - start,
            decoded=decoded,
        )
        return checked.to_dict()

    def abort(self, reason: str, owner: str | None = None) -> None:
        with self._lock:
            if self._open is not None and owner is not None and owner != self._owner:
                logger.warning(
                    "%s: an abort from %s left update %r of %s open: %s",
                    self.engine_name,
                    owner,
                    self._open,
                    self._owner,
                    reason,
                )
                return
            try:
                if self._open is not None:
                    logger.warning(
                        "%s: update %r aborted: %s", self.engine_name, self._open, reason
                    )
                    if self._engine_abort(reason):
                        done = (
                            "the trainer began writing into the parameters"
                            if self._one_copy
                            else f"{self._loaded} bucket(s)"
                        )
                        self._broken = (
                            f"update {self._open!r} was aborted after {done} ({reason}); sync again"
                        )
            finally:
                self._open = None
                self._resume_generation()
                if self._broken:  # a staged update paused nothing: say so all the same
                    self._server_serves(refuse=self._broken)

    def _server_serves(self, *, refuse: str | None) -> None:
        """`_refuse`, its failure logged (the engine itself may be what failed)."""
        try:
            self._refuse(refuse)
        except Exception as exc:
            logger.warning(
                "%s: telling its server to serve or refuse failed: %s", self.engine_name, exc
            )

    def _refuse(self, reason: str | None) -> None:
        """An engine's server answers its own clients with `reason` (None: serves them again)
        until a sync completes (where it can: a server weightsync's gate fronts)."""

    def p2p_support(self) -> str | None:
        if type(self)._engine_p2p_open is EngineSession._engine_p2p_open:
            return f"{type(self).__name__} has no point-to-point receiver"
        return None

    def _engine_p2p_open(
        self, plan: dict, first_worker: int, host: str, port: int, backend: str, timeout_s: float
    ) -> str | None:
        """Every worker joins the plan's group (`p2p_open`); why not, or None."""
        raise NotImplementedError

    def _engine_p2p_receive(self) -> LoadReport:
        """Inside the open update: every worker receives and writes its pieces."""
        raise NotImplementedError

    def p2p_open(
        self,
        plan: dict,
        first_worker: int,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> dict:
        why = self.p2p_support()
        if why is None:
            with self._lock:
                why = self._engine_p2p_open(plan, first_worker, host, port, backend, timeout_s)
        return {"why": why}

    def p2p_receive(self, version: str) -> dict:
        """As `load_bucket`, for the point-to-point path: refused outside update `version`;
        once it began, the weights may be mixed until the update ends."""
        with self._lock:
            if self._open is None or self._open != version:
                raise BucketRejected(
                    f"{self.engine_name}: a point-to-point receive of update {version!r} while "
                    f"update {self._open!r} is open; refused, nothing was read"
                )
            self._last_call = time.perf_counter()
            try:
                result = self._engine_p2p_receive()
            except BucketRejected:
                raise  # failed before any byte was written: the weights are still whole
            except BaseException:
                self._loaded += 1  # it may have been partly written
                raise
            finally:
                self._last_call = time.perf_counter()
            self._loaded += 1
            return result.to_dict()

    def share_params(self) -> dict:
        """Generation is paused while the engine moves its parameters and probes them."""
        with self._lock:
            paused_here = not self._pausing.paused
            self._pause_generation()
            try:
                return self._engine_share()
            finally:
                if paused_here:
                    self._resume_generation()

    def _pause_generation(self) -> None:
        self._pausing.pause()

    def _resume_generation(self) -> None:
        self._pausing.resume()

    def weight_version(self) -> str | None:
        self._expire_idle()
        return self._version

    def release_staged(self) -> dict:
        """Free the staged copy of the parameters that staged updates load into
        (weightsync/engine/staging.py), which they otherwise keep between syncs: {"released_bytes":
        what it held, over every worker; 0 without one}. The next staged update makes it again
        from the served weights (a full copy, while the engine serves), and the last switch can
        no longer be reverted. Refused while an update is open."""
        with self._lock:
            self._expire_idle()
            if self._open is not None:
                raise RuntimeError(
                    f"{self.engine_name}: release_staged during update {self._open!r}; release "
                    f"the staged copy once it ends"
                )
            released = self._engine_release_staged()
            self._revert_to, self._holds_copy = None, False
            logger.info("%s: staged copy released (%d bytes)", self.engine_name, released)
            return {"released_bytes": released}

    def _release_unstaged(self, version: str) -> None:
        """Staged updates stopped: an update that is not staged writes the served weights,
        after which a staged copy would be made again whole anyway, so it is freed now rather
        than held to the next staged update. A failure to free it is logged: the update goes on."""
        self._holds_copy = False
        try:
            released = self._engine_release_staged()
        except Exception as exc:  # housekeeping: the copy stays, stale, until released
            logger.warning("%s: the staged copy was not released: %s", self.engine_name, exc)
            return
        logger.info(
            "%s: staged copy released (%d bytes): update %r is not staged",
            self.engine_name,
            released,
            version,
        )

    def _engine_release_staged(self) -> int:
        """Drop the staged copy, if the engine holds one: the bytes it held."""
        return 0

    def revert(self, switch_at: float | None = None) -> dict:
        """Serve again the weights the last update replaced, and their version tag: after a
        staged update whose switch kept them (`SyncOptions(staged=True, keep_previous=True)`),
        before any other update. In one short pause, as the switch (`EndReport`'s `pause_s`,
        `switched_at`). A revert that fails after writing leaves the engine refusing to serve
        until a sync completes; one that wrote nothing (the prefix cache could not be reset),
        or whose writes every worker undid (`NothingSwitched` from `_engine_revert`), can be
        asked again. `switch_at`: as `end`'s, the instant the sender named for every
        engine's revert."""
        with self._lock:
            self._expire_idle()
            if self._open is not None:
                raise RuntimeError(
                    f"{self.engine_name}: revert during update {self._open!r}; abort it first"
                )
            if type(self)._engine_revert is EngineSession._engine_revert:
                raise NotImplementedError(
                    f"{self.engine_name}: {type(self).__name__} cannot revert a switch (its "
                    f"staged switch does not keep the weights it replaces)"
                )
            if self._revert_to is None:
                raise RuntimeError(
                    f"{self.engine_name}: nothing to revert: the last update was not a staged "
                    f"one switched with keep_previous=True (SyncOptions(staged=True, "
                    f"keep_previous=True)), or another update or a revert came after it"
                )
            (version,) = self._revert_to
            if switch_at is not None:
                wait_until(float(switch_at))
            try:  # the engine's tag of the weights it started with: ""
                report = self._engine_revert(version or "")
            except (NotImplementedError, NothingSwitched):
                raise  # nothing was written: the engine serves on, the revert may be asked again
            except Exception as exc:
                self._revert_to = None
                self._broken = f"the revert to {version!r} failed ({exc}); sync again"
                self._server_serves(refuse=self._broken)
                raise
            if switch_at is not None:
                report = replace(report, switch_at=float(switch_at))
            self._revert_to, self._version = None, version
            return report.to_dict()

    def _expire_idle(self) -> None:
        with self._lock:
            idle = time.perf_counter() - self._last_call
            if self._open is not None and idle > self.idle_timeout_s:
                self.abort(
                    f"its sender made no call for {idle:.0f} s (idle_timeout_s="
                    f"{self.idle_timeout_s:g}); it is presumed dead"
                )

    def check_serving(self) -> None:
        """Raise unless the engine holds one complete set of weights. A framework that drives
        the engine from several threads (a threaded actor, a sampling thread beside weightsync's
        calls) generates inside `serving()` instead."""
        self._expire_idle()
        if self._broken:
            raise RuntimeError(f"{self.engine_name} engine does not serve: {self._broken}")
        if self._open and (not self._into_copy or self._switching):
            raise RuntimeError(
                f"{self.engine_name} engine does not serve during update {self._open!r}"
                + (" (its switch did not complete)" if self._into_copy else "")
            )

    @contextmanager
    def serving(self) -> Iterator[None]:
        """For the block, the engine computes with one version's weights whole: refused as
        `check_serving` refuses, then every call of weightsync's (a staged update's loads and
        switch, any update's `begin`) waits until the block ends, and the block waits for the
        one in progress. An in-process engine's generation that can run beside weightsync's
        calls (`llm=` / `engine=` in a framework's threaded actor) runs inside it; a staged
        update then serves that generation between its calls."""
        with self._lock:
            self.check_serving()
            yield


def _staged_answer(report: StageReport, expect: list[str] | None) -> dict:
    """`stage`'s answer: `report`, or only `same` where every worker's fingerprints digest
    to what the trainer expects (`same_prints`)."""
    if same_prints(report.fingerprints, expect):
        return StageReport(fingerprints=[], same=True).to_dict()
    return report.to_dict()


class GenerationPause:
    """An `EngineSession`'s generation pause: its `_pause`/`_resume` hooks called once per
    pause, and while paused a watchdog thread that expires an update whose sender went
    silent (`_expire_idle`), so a dead trainer does not leave the server paused until
    someone calls the actor."""

    def __init__(self, session: EngineSession) -> None:
        self.session = session
        self.paused = False
        self._count = 0  # pauses so far: a watchdog serves only its own

    def pause(self) -> None:
        if self.paused:
            return
        self.paused = self.session._pause()
        if self.paused:
            self._count += 1
            threading.Thread(
                target=self._watch,
                args=(self._count,),
                daemon=True,
                name=f"{self.session.engine_name}-idle-watchdog",
            ).start()

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        try:
            self.session._resume()
        except Exception as exc:
            raise RuntimeError(
                f"{self.session.engine_name}: resuming generation failed "
                f"({exc}); the engine may stay paused until the next update "
                f"ends"
            ) from exc

    def _watch(self, pause: int) -> None:
        """While pause number `pause` lasts: expire a silent update without waiting for a
        call to the actor."""
        session = self.session
        while True:
            time.sleep(min(1.0, session.idle_timeout_s / 4))
            with session._lock:
                if not self.paused or self._count != pause:
                    return
                try:
                    session._expire_idle()
                except Exception:
                    logger.exception("%s: expiring a silent update failed", session.engine_name)
                    return


SWITCH_WAIT_MAX_S = 60.0  # the longest an engine waits for a named switch instant


def wait_until(instant: float) -> None:
    """Sleep until wall-clock `instant` (`time.time()` seconds); at once when it has passed,
    and for at most `SWITCH_WAIT_MAX_S` (a sender whose clock runs ahead of this host's does
    not hold the engine longer). The last stretch is spun, since a sleep may overshoot by a
    scheduler tick."""
    latest = time.time() + SWITCH_WAIT_MAX_S
    if instant > latest:
        logger.warning(
            "a switch instant %.1f s ahead: waiting %.0f s at most (are the hosts' clocks apart?)",
            instant - time.time(),
            SWITCH_WAIT_MAX_S,
        )
        instant = latest
    while True:
        left = instant - time.time()
        if left <= 0:
            return
        if left > 0.002:
            time.sleep(left - 0.001)
