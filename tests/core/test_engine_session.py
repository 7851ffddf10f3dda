"""`EngineSession`'s pause rules, with a test double for the engine hooks: generation is paused
from `begin` until the update is closed; whatever closes it (`end`, `abort`, an idle expiry,
at a call or by the watchdog thread while paused) resumes; a failed `end` leaves it open and
paused until the sender's `abort`."""

from __future__ import annotations

import time

import pytest

from weightsync.engine.session import EngineSession
from weightsync.wire.protocol import EndReport, LoadReport

BUCKET = {"index": 0, "nbytes": 4, "handle": {}, "tensors": []}


class PausingEngine(EngineSession):
    """An engine whose server pauses, and which records what the session asked of it."""

    engine_name = "double"

    def __init__(
        self, *, idle_timeout_s: float = 60.0, fail_end: bool = False, fail_begin: bool = False
    ) -> None:
        super().__init__(idle_timeout_s=idle_timeout_s)
        self.generating = True
        self.aborted: list[str] = []
        self.fail_end = fail_end
        self.fail_begin = fail_begin

    def _pause(self) -> bool:
        assert self.generating, "paused twice"
        self.generating = False
        return True

    def _resume(self) -> None:
        assert not self.generating, "resumed without a pause"
        self.generating = True

    def _engine_begin(self, one_copy: bool) -> str | None:
        if self.fail_begin:
            raise RuntimeError("engine refused to begin")
        return None

    def _engine_load(self, descriptor: dict) -> LoadReport:
        return LoadReport(num_tensors=1, nbytes=4, seconds=0.0)

    def _engine_end(self, version: str) -> EndReport:
        if self.fail_end:
            raise RuntimeError("post-processing failed")
        return EndReport(weight_version=version)

    def _engine_abort(self, reason: str) -> bool:
        self.aborted.append(reason)
        return True  # a bucket was loaded and not put back: the weights may be mixed

    def check_refit(self, specs: list[dict]) -> dict:
        return {}

    def fingerprints(self) -> dict[str, list[int]]:
        return {}


def test_generation_is_paused_from_begin_until_end():
    engine = PausingEngine()
    engine.begin("v1")
    assert not engine.generating
    engine.load_bucket(BUCKET)
    assert not engine.generating
    engine.end("v1")
    assert engine.generating
    assert engine.weight_version() == "v1"


def test_an_aborted_update_resumes_generation():
    engine = PausingEngine()
    engine.begin("v1")
    engine.load_bucket(BUCKET)
    engine.abort("the trainer failed")
    assert engine.generating
    assert engine.aborted == ["the trainer failed"]
    with pytest.raises(
        RuntimeError,
        match=r"does not serve: update 'v1' was aborted after 1 "
        r"bucket\(s\) \(the trainer failed\)",
    ):
        engine.check_serving()


def test_a_failed_begin_resumes_generation():
    engine = PausingEngine(fail_begin=True)
    with pytest.raises(RuntimeError, match="engine refused to begin"):
        engine.begin("v1")
    assert engine.generating
    engine.check_serving()


def test_an_update_idle_past_idle_timeout_s_expires_at_the_next_call_and_resumes():
    engine = PausingEngine(idle_timeout_s=60.0)
    engine.begin("v1")
    engine.load_bucket(BUCKET)
    engine._last_call -= 61.0  # the sender's last call, 61 s ago; the watchdog has not looked
    with pytest.raises(
        RuntimeError,
        match=r"does not serve: update 'v1' was aborted .*its "
        r"sender made no call for 61 s",
    ):
        engine.check_serving()
    assert engine.generating
    assert engine.weight_version() is None


def test_a_failed_end_stays_paused_until_the_senders_abort():
    engine = PausingEngine(fail_end=True)
    engine.begin("v1")
    engine.load_bucket(BUCKET)
    with pytest.raises(RuntimeError, match="post-processing failed"):
        engine.end("v1")
    assert not engine.generating
    with pytest.raises(RuntimeError, match="does not serve during update 'v1'"):
        engine.check_serving()
    assert not engine.generating
    engine.abort("end failed")
    assert engine.generating
    assert engine.aborted == ["end failed"]
    assert engine.weight_version() is None


def _wait_until_generating(engine: PausingEngine, *, within_s: float) -> float:
    """Seconds until the engine generates again, reading only the double's own flag (no call
    to the session)."""
    start = time.perf_counter()
    while not engine.generating:
        if time.perf_counter() - start > within_s:
            break
        time.sleep(0.02)
    return time.perf_counter() - start


def test_while_paused_the_watchdog_expires_a_silent_update_without_a_call():
    engine = PausingEngine(idle_timeout_s=0.5)
    engine.begin("v1")
    engine.load_bucket(BUCKET)
    waited_s = _wait_until_generating(engine, within_s=10.0)
    assert engine.generating, f"still paused {waited_s:.1f} s after the sender's last call"
    assert 0.5 <= waited_s < 5.0
    assert len(engine.aborted) == 1
    assert "its sender made no call" in engine.aborted[0]
    assert "idle_timeout_s=0.5" in engine.aborted[0]
    with pytest.raises(RuntimeError, match="does not serve: update 'v1' was aborted"):
        engine.check_serving()


def test_the_watchdog_leaves_an_update_whose_sender_keeps_calling():
    engine = PausingEngine(idle_timeout_s=0.5)
    engine.begin("v1")
    for _ in range(15):  # 1.5 s of loads, each well within idle_timeout_s of the last
        time.sleep(0.1)
        engine.load_bucket(BUCKET)
    assert not engine.generating
    assert engine.aborted == []
    engine.end("v1")
    assert engine.generating
    assert engine.weight_version() == "v1"


class StagingEngine(PausingEngine):
    """A `PausingEngine` that can stage: it records the updates it opened staged."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: list[bool] = []

    def staged_support(self) -> str | None:
        return None

    def _engine_begin(self, one_copy: bool) -> str | None:
        self.staged.append(self._into_copy)
        return None

    def _engine_abort(self, reason: str) -> bool:
        self.aborted.append(reason)
        return not self._into_copy  # a staged update never wrote the served weights


def test_a_staged_update_serves_on_and_its_abort_leaves_the_engine_serving():
    engine = StagingEngine()
    engine.begin("v1", False, "t", True)
    assert engine.generating and engine.staged == [True]
    engine.check_serving()  # no refusal: the served weights are whole
    engine.load_bucket(BUCKET)
    engine.abort("verification failed", "t")
    assert engine.generating
    engine.check_serving()
    assert engine.weight_version() is None
    engine.begin("v2", False, "t", True)
    engine.load_bucket(BUCKET)
    engine.end("v2")
    assert engine.weight_version() == "v2" and engine.generating


def test_an_update_after_a_staged_one_pauses_again():
    engine = StagingEngine()
    engine.begin("v1", False, "t", True)
    engine.end("v1")
    engine.begin("v2")
    assert not engine.generating and engine.staged == [True, False]
    with pytest.raises(RuntimeError, match="does not serve during update 'v2'"):
        engine.check_serving()
    engine.end("v2")


def test_staged_updates_are_refused_where_unsupported_or_asked_with_one_copy():
    with pytest.raises(ValueError, match="PausingEngine has no staged updates"):
        PausingEngine().begin("v1", False, "t", True)
    engine = StagingEngine()
    with pytest.raises(ValueError, match="a staged update goes by buckets"):
        engine.begin("v1", True, "t", True)
    assert engine.staged == [] and engine.generating
    engine.begin("v1", False, "t", True)
    engine.end("v1")


class FailingSwitchEngine(StagingEngine):
    """A `StagingEngine` whose switch fails after it began writing the served weights."""

    def _engine_end(self, version: str) -> EndReport:
        self._switching = True
        raise RuntimeError("a worker's switch failed")

    def _engine_abort(self, reason: str) -> bool:
        self.aborted.append(reason)
        return self._switching


def test_a_staged_update_whose_switch_failed_is_not_served_from_then_on():
    """From the failed switch on (before the trainer's abort arrives) the engine refuses to
    serve, and after the abort it goes on refusing until a sync completes."""
    engine = FailingSwitchEngine()
    engine.begin("v1", False, "t", True)
    engine.load_bucket(BUCKET)
    engine.check_serving()
    with pytest.raises(RuntimeError, match="a worker's switch failed"):
        engine.end("v1")
    with pytest.raises(RuntimeError, match="its switch did not complete"):
        engine.check_serving()
    engine.abort("the switch failed", "t")
    with pytest.raises(RuntimeError, match="does not serve"):
        engine.check_serving()


class RevertingEngine(StagingEngine):
    """A `StagingEngine` whose switch keeps what it replaces (as vLLM's under keep_previous);
    its revert fails once after writing, once before (`fail`), where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.reverts: list[str] = []
        self.fail: Exception | None = None

    def _engine_swaps(self) -> bool:
        return True

    def _engine_revert(self, version: str) -> EndReport:
        if self.fail is not None:
            raise self.fail
        self.reverts.append(version)
        return EndReport(weight_version=version, pause_s=0.001)


def test_revert_goes_back_one_staged_update_and_only_until_the_next_update():
    """`revert` after a staged update whose switch kept the previous weights: the previous
    version tag again, once; refused, naming why, where nothing is kept (before any update, a
    second time, after an update that is not staged), during an update, and by an engine that
    cannot revert. A revert that wrote nothing may be asked again; one that failed after
    writing leaves the engine refusing to serve."""
    from weightsync.engine.session import NothingSwitched

    with pytest.raises(NotImplementedError, match="StagingEngine cannot revert a switch"):
        StagingEngine().revert()
    engine = RevertingEngine()
    with pytest.raises(RuntimeError, match="nothing to revert"):
        engine.revert()
    for version in ("v1", "v2"):
        engine.begin(version, False, "t", True)
        engine.end(version)
    assert engine.revert()["weight_version"] == "v1" and engine.weight_version() == "v1"
    with pytest.raises(RuntimeError, match="nothing to revert"):
        engine.revert()
    engine.begin("v3", False, "t", True)
    with pytest.raises(RuntimeError, match="revert during update 'v3'"):
        engine.revert()
    engine.end("v3")
    engine.begin("v4")  # not staged: it writes the served weights
    engine.end("v4")
    with pytest.raises(RuntimeError, match="nothing to revert"):
        engine.revert()
    engine.begin("v5", False, "t", True)
    engine.end("v5")
    engine.fail = NothingSwitched("the prefix cache could not be reset")
    with pytest.raises(NothingSwitched):
        engine.revert()
    engine.check_serving()
    engine.fail = RuntimeError("worker 1's swap failed")
    with pytest.raises(RuntimeError, match="worker 1's swap failed"):
        engine.revert()
    with pytest.raises(RuntimeError, match="the revert to 'v4' failed"):
        engine.check_serving()
    assert engine.reverts == ["v1"] and engine.weight_version() == "v5"


class TimedEngine(RevertingEngine):
    """A `RevertingEngine` that notes when each switch and revert began."""

    def __init__(self) -> None:
        super().__init__()
        self.switched: list[float] = []

    def _engine_end(self, version: str) -> EndReport:
        self.switched.append(time.time())
        return super()._engine_end(version)

    def _engine_revert(self, version: str) -> EndReport:
        self.switched.append(time.time())
        return super()._engine_revert(version)


def test_a_staged_update_switches_at_the_instant_its_sender_named():
    """`end(..., switch_at=)` on a staged update (`SyncOptions.switch_lead_s`): the engine
    serves on until that instant, then switches, and reports the instant (`switch_at`); an
    instant already passed switches at once. `revert(switch_at=)` likewise. An update that is
    not staged pays no wait and reports none."""
    engine = TimedEngine()
    engine.begin("v1", False, "t", True)
    at = time.time() + 0.3
    report = engine.end("v1", None, None, at)
    assert engine.switched[-1] >= at and report["switch_at"] == at
    assert engine.generating and engine.weight_version() == "v1"
    engine.begin("v2", False, "t", True)
    start = time.time()
    assert engine.end("v2", None, None, start - 5)["switch_at"] == start - 5
    assert engine.switched[-1] - start < 0.25  # no wait (a loose bound: this machine is shared)
    at = time.time() + 0.3
    assert engine.revert(at)["switch_at"] == at and engine.switched[-1] >= at
    assert engine.weight_version() == "v1"
    engine.begin("v3")  # not staged: the engine paused at begin, and switches when told
    start = time.time()
    report = engine.end("v3", None, None, start + 30)
    assert "switch_at" not in report and engine.switched[-1] - start < 5


class PreparingEngine(TimedEngine):
    """A `TimedEngine` that notes when it readied a switch (`_engine_prepare`)."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[float] = []

    def _engine_prepare(self) -> None:
        self.prepared.append(time.time())


def test_a_staged_switch_is_readied_before_the_pause_once_where_stage_did_not():
    """An unverified staged update's switch is readied (`_engine_prepare`: the batched copies
    planned) in `end` before the named instant, not inside the switch's pause; a verified one
    readied it at `stage`, and an update that is not staged has no switch to ready."""
    engine = PreparingEngine()
    engine.begin("v1", False, "t", True)
    at = time.time() + 0.3
    engine.end("v1", None, None, at)
    assert len(engine.prepared) == 1 and engine.prepared[0] < at <= engine.switched[-1]
    engine.begin("v2", False, "t", True)
    engine.stage("v2")
    engine.end("v2")
    assert len(engine.prepared) == 1  # `stage` readied it
    engine.begin("v3")
    engine.end("v3")
    assert len(engine.prepared) == 1
    engine.begin("v4", False, "t", True)
    engine.end("v4")
    assert len(engine.prepared) == 2 and engine.prepared[1] <= engine.switched[-1]


def test_a_switch_instant_far_ahead_is_waited_for_at_most_switch_wait_max_s(monkeypatch):
    """A sender whose clock runs ahead names an instant far off: the engine waits at most
    `SWITCH_WAIT_MAX_S`, not until it."""
    import weightsync.engine.session as session

    monkeypatch.setattr(session, "SWITCH_WAIT_MAX_S", 0.2)
    engine = TimedEngine()
    engine.begin("v1", False, "t", True)
    start = time.time()
    engine.end("v1", None, None, start + 3600)
    assert 0.2 <= engine.switched[-1] - start < 5 and engine.weight_version() == "v1"


def test_release_staged_is_refused_while_an_update_is_open_and_frees_the_copy_after():
    class Staging(PausingEngine):
        held = 1024

        def _engine_release_staged(self) -> int:
            released, self.held = self.held, 0
            return released

    engine = Staging()
    engine.begin("v1")
    with pytest.raises(RuntimeError, match="release_staged during update 'v1'"):
        engine.release_staged()
    engine.end("v1")
    assert engine.release_staged() == {"released_bytes": 1024}
    assert engine.release_staged() == {"released_bytes": 0}
    assert PausingEngine().release_staged() == {"released_bytes": 0}  # no copy: nothing held


def test_an_update_that_is_not_staged_frees_the_staged_copy_once():
    """Staged updates stop when one that is not staged comes: it writes the served weights, so
    the copy would be made again whole anyway; its `begin` frees it (once, before pausing)."""

    class Releasing(StagingEngine):
        def __init__(self) -> None:
            super().__init__()
            self.held, self.released = 0, []

        def _engine_begin(self, one_copy: bool) -> str | None:
            self.held = 4096 if self._into_copy else self.held
            return super()._engine_begin(one_copy)

        def _engine_release_staged(self) -> int:
            self.released.append(self.generating)
            freed, self.held = self.held, 0
            return freed

    engine = Releasing()
    engine.begin("v1")
    engine.end("v1")
    assert engine.released == []  # no staged update yet: nothing to free
    for version in ("v2", "v3"):
        engine.begin(version, False, "t", True)
        engine.end(version)
    assert engine.released == [] and engine.held == 4096  # kept between staged updates
    engine.begin("v4")
    assert engine.released == [True] and engine.held == 0  # freed before the pause
    engine.end("v4")
    engine.begin("v5")
    engine.end("v5")
    assert engine.released == [True]  # once
    engine.begin("v6", False, "t", True)
    engine.end("v6")
    assert engine.release_staged() == {"released_bytes": 4096}
    assert len(engine.released) == 2
    engine.begin("v7")
    engine.end("v7")
    assert len(engine.released) == 2  # released on request already: v7 frees nothing


def test_an_update_goes_on_when_freeing_the_staged_copy_fails(caplog):
    class Failing(StagingEngine):
        def _engine_release_staged(self) -> int:
            raise RuntimeError("worker 1 is gone")

    engine = Failing()
    engine.begin("v1", False, "t", True)
    engine.end("v1")
    with caplog.at_level("WARNING"):
        engine.begin("v2")
    assert "staged copy was not released: worker 1 is gone" in caplog.text
    engine.end("v2")
    assert engine.weight_version() == "v2"


class ProbedStagingEngine(StagingEngine):
    """A `StagingEngine` whose forward scores a probe (`scores`), recording what it was asked
    in order (`steps`); its switch swaps (keeps the previous weights) where `swaps`."""

    def __init__(self, *, swaps: bool) -> None:
        super().__init__()
        self.swaps = swaps
        self.scores = [-1.0, -2.0]
        self.steps: list[str] = []

    def _pause(self) -> bool:
        self.steps.append("hold")
        return super()._pause()

    def _resume(self) -> None:
        self.steps.append("release")
        super()._resume()

    def _engine_end(self, version: str) -> EndReport:
        self.steps.append(f"switch to {version}")
        self._switching = True
        return EndReport(weight_version=version)

    def _engine_probe(self, tokens: list[list[int]]) -> list[list[float]]:
        assert not self.generating, "probed while generating"
        self.steps.append("probe")
        return [list(self.scores)]

    def _engine_swaps(self) -> bool:
        return self.swaps

    def _engine_revert(self, version: str) -> EndReport:
        self.steps.append(f"switch back to {version}")
        return EndReport(weight_version=version)


def _probe_request() -> dict:
    from weightsync.wire.probe import ProbeRequest

    return ProbeRequest(tokens=[[1, 2, 3]], expected=[[-1.0, -2.0]], bound=0.1).to_dict()


def test_a_staged_update_is_probed_just_after_its_switch_with_generation_held():
    """Loading serves on; at `end` generation is held, the update switched in, the probe scored
    on the weights now served, generation released: a probe that passes is in the report."""
    engine = ProbedStagingEngine(swaps=True)
    engine.begin("v1", False, "t", True)
    engine.load_bucket(BUCKET)
    assert engine.generating
    report = engine.end("v1", probe=_probe_request())
    assert engine.steps == ["hold", "switch to v1", "probe", "release"]
    assert report["probe"]["num_tokens"] == 2 and report["probe"]["mean_gap"] == 0.0
    assert engine.weight_version() == "v1" and engine.generating
    engine.check_serving()
    engine.begin("v2", False, "t", True)  # without a probe: no hold but the switch's own
    engine.end("v2")
    assert engine.steps[-1] == "switch to v2" and engine.generating


def test_a_staged_update_that_fails_its_probe_is_switched_back_before_generation_goes_on():
    """A probe that fails after the switch: with keep_previous (a swapping switch) the engine
    switches back to the previous weights while generation is still held and serves them;
    the error says so and the sender's abort finds nothing left open."""
    from weightsync.wire.errors import ProbeFailed

    engine = ProbedStagingEngine(swaps=True)
    engine.begin("v1", False, "t", True)
    engine.end("v1")
    engine.scores = [-1.0, -2.9]  # 0.45 nats a token off: past the bound
    engine.begin("v2", False, "t", True)
    engine.load_bucket(BUCKET)
    engine.steps.clear()
    with pytest.raises(ProbeFailed, match="probed after its switch: it serves 'v1' again"):
        engine.end("v2", probe=_probe_request())
    assert engine.steps == ["hold", "switch to v2", "probe", "switch back to v1", "release"]
    engine.abort("the probe failed", "t")
    assert engine.aborted == []  # the update had ended: nothing to abort
    assert engine.weight_version() == "v1" and engine.generating
    engine.check_serving()
    with pytest.raises(RuntimeError, match="nothing to revert"):
        engine.revert()  # v1 is served: there is nothing before it to go back to


def test_an_engines_first_staged_update_with_keep_previous_reverts_to_its_start_up_weights():
    """The first update of an engine serving the weights it started with (no version yet),
    staged and swapping: `revert` puts those back (the engine's tag "", the session's version
    None), as the all-or-none switch of several engines needs; nothing is left after it."""
    engine = ProbedStagingEngine(swaps=True)
    engine.begin("v1", False, "t", True)
    engine.end("v1")
    assert engine.revert()["weight_version"] == ""
    assert engine.steps[-1] == "switch back to " and engine.weight_version() is None
    with pytest.raises(RuntimeError, match="nothing to revert"):
        engine.revert()


def test_a_staged_update_that_fails_its_probe_without_keep_previous_refuses_to_serve():
    """Without keep_previous the switch copied over the previous weights: the failed probe
    leaves the engine refusing to serve (its server's clients too) until a sync completes."""
    from weightsync.wire.errors import ProbeFailed

    engine = ProbedStagingEngine(swaps=False)
    engine.scores = [-1.0, -2.9]
    engine.begin("v1", False, "t", True)
    with pytest.raises(ProbeFailed, match="it refuses to serve: its switch did not keep"):
        engine.end("v1", probe=_probe_request())
    assert engine.steps == ["hold", "switch to v1", "probe", "release"]
    with pytest.raises(RuntimeError, match="does not serve: update 'v1' failed its probe"):
        engine.check_serving()
    engine.scores = [-1.0, -2.0]
    engine.begin("v2", False, "t", True)
    engine.end("v2", probe=_probe_request())
    engine.check_serving()
    assert engine.weight_version() == "v2"


def test_generation_inside_serving_runs_between_weightsyncs_calls_never_beside_one():
    """A framework's sampling thread generating inside `serving()` while a staged update loads
    and switches: each load, switch and generation runs alone (none overlaps another), the
    generation goes on between the update's calls, and during an update that is not staged
    `serving()` refuses."""
    import threading

    log: list[str] = []

    class Recording(StagingEngine):
        def _engine_load(self, descriptor: dict) -> LoadReport:
            log.append("load+")
            time.sleep(0.02)
            log.append("load-")
            return super()._engine_load(descriptor)

        def _engine_end(self, version: str) -> EndReport:
            log.append("switch+")
            time.sleep(0.02)
            log.append("switch-")
            return super()._engine_end(version)

    engine = Recording()
    stop, refused = threading.Event(), []

    def sample() -> None:
        while not stop.is_set():
            try:
                with engine.serving():
                    log.append("gen+")
                    time.sleep(0.005)
                    log.append("gen-")
            except RuntimeError as exc:
                refused.append(str(exc))
                time.sleep(0.005)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        for version in ("v1", "v2"):
            engine.begin(version, False, "t", True)
            for _ in range(5):
                engine.load_bucket(BUCKET)
                time.sleep(0.01)  # the trainer's next bucket on its way
            engine.end(version)
        assert not refused  # a staged update serves on
        engine.begin("v3")
        time.sleep(0.05)
        assert refused and "does not serve during update 'v3'" in refused[-1]
        engine.end("v3")
    finally:
        stop.set()
        thread.join()
    pairs = list(zip(log[::2], log[1::2]))
    assert all(a[:-1] == b[:-1] and (a[-1], b[-1]) == ("+", "-") for a, b in pairs), log
    steps = [a[:-1] for a, _ in pairs]
    assert steps.count("load") == 10 and steps.count("switch") == 3  # v3 ends by it too
    first, last = steps.index("load"), len(steps) - 1 - steps[::-1].index("switch")
    assert "gen" in steps[first:last], "no generation between the update's calls"
