"""Clients that call an engine's HTTP server directly while a trainer syncs many versions into
it, and the check that no complete response mixes two versions (tests/reliability/test_*_pause.py).

Each sync is to a different set of random weights (`set_weights_from(seed)`), whose greedy
float32 reference is computed first. A version is live from the start of the sync that brings
it until the end of the sync that replaces it; a complete response must equal, token for token,
the reference of a version live at some moment between its request and its answer. A response
decoded partly on half-written weights, or on weights of two versions, equals none of them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray

from tests.engine_checks import prompt_ids
from weightsync.engine.server import http_json

MAX_NEW_TOKENS = 8
NUM_CLIENTS = 3
STAGED_SYNCS = 12  # `check_staged_syncs_under_requests`: at most
MIN_STAGED_SYNCS = 2


@dataclass(slots=True)
class Answer:
    """One request: when it was sent and answered, and what came back."""

    prompt: int
    sent_s: float
    done_s: float
    tokens: list[int] | None  # None: aborted or failed
    outcome: str  # "complete", "aborted" or "failed: ..."
    tag: str | None = None  # the engine's own weight-version tag, where it gives one


@dataclass(slots=True)
class Hammer:
    """`NUM_CLIENTS` threads sending greedy requests for fixed prompts until stopped. `ask`
    sends one request: (status, decoded JSON); `parse` turns a 200 answer into (tokens or None
    when aborted, engine tag)."""

    ask: Callable[[list[int]], tuple[int, Any]]
    parse: Callable[[Any], tuple[list[int] | None, str | None]]
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        prompts = prompt_ids()
        for client in range(NUM_CLIENTS):
            thread = threading.Thread(target=self._run, args=(prompts, client), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
        failed = [a for a in self.answers if a.outcome.startswith("failed")]
        longest = max((a.done_s - a.sent_s for a in self.answers), default=0.0)
        print(
            f"hammer: {len(self.answers)} answers, {len(failed)} failed"
            + (f" (first: {failed[0].outcome[:160]})" if failed else "")
            + f", longest request {longest:.1f} s",
            flush=True,
        )

    def _run(self, prompts: list[list[int]], client: int) -> None:
        i = client
        while not self._stop.is_set():
            k = i % len(prompts)
            i += 1
            sent = time.monotonic()
            try:
                status, out = self.ask(prompts[k])
            except OSError as exc:
                self.answers.append(Answer(k, sent, time.monotonic(), None, f"failed: {exc}"))
                time.sleep(0.2)
                continue
            done = time.monotonic()
            if status != 200:
                self.answers.append(Answer(k, sent, done, None, f"failed: {status} {out}"))
                time.sleep(0.2)
                continue
            tokens, tag = self.parse(out)
            self.answers.append(
                Answer(k, sent, done, tokens, "complete" if tokens is not None else "aborted", tag)
            )


def post_json(
    base: str, path: str, body: Any, *, api_key: str | None, timeout_s: float = 300
) -> tuple[int, Any]:
    return http_json("POST", base + path, body, api_key=api_key, timeout=timeout_s)


def run_syncs_under_requests(
    trainer, name: str, hammer: Hammer, *, num_syncs: int, first_seed: int = 1000
) -> dict[str, Any]:
    """References for the weights now served (version 0) and for `num_syncs` more versions,
    then the syncs back to back while `hammer` runs. Returns what `check_answers` needs."""
    ids = prompt_ids()
    refs = [trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)["tokens"]]
    for i in range(1, num_syncs + 1):
        trainer.call("set_weights_from", first_seed + i)
        refs.append(
            trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)["tokens"]
        )
    # A version answering exactly as the one before it could hide a mixed answer.
    alike = [v for v in range(1, len(refs)) if refs[v] == refs[v - 1]]
    assert not alike, f"versions {alike} answer as the version before them"
    windows: list[tuple[float, float]] = []  # sync i brings version i + 1
    paths: list[str] = []
    hammer.start()
    try:
        time.sleep(2)  # answers of version 0 first
        for i in range(1, num_syncs + 1):
            trainer.call("set_weights_from", first_seed + i)
            start = time.monotonic()
            report = trainer.call("sync", f"v{i}")
            windows.append((start, time.monotonic()))
            print(f"sync v{i} done in {windows[-1][1] - start:.2f} s", flush=True)
            paths.append(report["engines"][name]["path"])
            time.sleep(0.3)  # some answers between syncs too
        time.sleep(2)
    finally:
        hammer.stop()
    return {"refs": refs, "windows": windows, "paths": paths}


def check_answers(
    hammer: Hammer,
    refs: list[list[list[int]]],
    windows: list[tuple[float, float]],
    *,
    tag_of: Callable[[int], str | None] | None = None,
) -> dict[str, Any]:
    """Every complete answer equals the reference of a version live around it (and, with
    `tag_of`, an answer that carries an engine tag carries that version's). Returns the
    counts ("tagged": complete answers that carried a tag)."""
    inf = float("inf")
    # Version v is live from the start of sync v (which brings it) to the end of sync v + 1.
    live = [
        (-inf if v == 0 else windows[v - 1][0], inf if v == len(windows) else windows[v][1])
        for v in range(len(refs))
    ]
    bad, num_during_sync = [], 0
    complete = [a for a in hammer.answers if a.outcome == "complete"]
    for a in complete:
        candidates = [v for v, (lo, hi) in enumerate(live) if lo <= a.done_s and a.sent_s <= hi]
        matches = [v for v in candidates if refs[v][a.prompt] == a.tokens]
        if any(a.sent_s <= hi and lo <= a.done_s for lo, hi in windows):
            num_during_sync += 1
        if not matches:
            anywhere = [v for v in range(len(refs)) if refs[v][a.prompt] == a.tokens]
            bad.append(
                f"prompt {a.prompt} at [{a.sent_s:.2f}, {a.done_s:.2f}] s: tokens "
                f"{a.tokens} match no live version {candidates} (any version: "
                f"{anywhere})"
            )
        elif tag_of is not None and a.tag is not None and a.tag not in [tag_of(v) for v in matches]:
            bad.append(
                f"prompt {a.prompt}: the tokens of version(s) {matches} came tagged {a.tag!r}"
            )
    counts = {
        "complete": len(complete),
        "complete_during_a_sync": num_during_sync,
        "aborted": sum(a.outcome == "aborted" for a in hammer.answers),
        "failed": sum(a.outcome.startswith("failed") for a in hammer.answers),
        "mixed_or_stale": len(bad),
        "tagged": sum(a.tag is not None for a in complete),
    }
    print(f"answers: {counts}")
    for line in bad[:10]:
        print("  BAD", line)
    failures = [a.outcome for a in hammer.answers if a.outcome.startswith("failed")]
    assert not bad, f"{len(bad)} of {len(complete)} complete answers mix versions: {bad[:3]}"
    assert not failures, f"{len(failures)} requests failed: {failures[:3]}"
    assert num_during_sync > 0, "no answer overlapped a sync: the test proved nothing"
    return counts


def vllm_spans_hammer(engine, versions: dict[str, int]) -> Hammer:
    """Requests to vLLM's /inference/v1/generate (a server started with `--enable-scale-out`);
    each answer tagged with the JSON of its version spans [[version index (`versions[tag]`,
    -1 for another), start, end], ...]."""
    import json

    base, key = engine_server(engine)

    def ask(prompt: list[int]):
        body = {
            "token_ids": prompt,
            "sampling_params": {
                "temperature": 0.0,
                "max_tokens": MAX_NEW_TOKENS,
                "ignore_eos": True,
            },
        }
        return post_json(base, "/inference/v1/generate", body, api_key=key)

    def parse(out):
        choice = out["choices"][0]
        if choice.get("finish_reason") == "abort":
            return None, None
        spans = [
            [versions.get(s["version"], -1), s["start"], s["end"]]
            for s in choice["weight_versions"]
        ]
        return choice["token_ids"], json.dumps(spans)

    return Hammer(ask, parse)


def engine_server(engine) -> tuple[str, str]:
    base = ray.get(engine.server_url.remote())
    key = ray.get(engine.server_api_key.remote())
    assert base and key, (base, key)
    return base, key


def check_a_request_waits_for_the_open_update(
    engine, trainer, hammer: Hammer, close: Callable[[], None], *, wait_s: float = 120.0
) -> tuple[float, str | None]:
    """Open an update and load a bucket into it (one tensor of random values, with
    keep_previous on), send one request straight to the server: it is not answered while the
    update is open. `close()` ends the update (the sender's abort, or nothing: the idle
    watchdog), which puts the previous weights back; then the request is answered on them,
    equal to the trainer's reference. Returns (seconds from `begin` to the answer, the engine's
    version tag of the answer). Nothing calls the actor between the load and the answer."""
    from tests.engine_checks import load_random

    prompt = prompt_ids()[0]
    want = trainer.call("reference_generate", [prompt], max_new_tokens=MAX_NEW_TOKENS)["tokens"]
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(hammer.ask(prompt)), daemon=True)
    ray.get(engine.set_keep_previous.remote(True), timeout=120)
    try:
        ray.get(engine.begin.remote("never-ends"), timeout=120)
        begun = time.monotonic()
        sender = load_random(engine, trainer.call("refit_info")[0])
        try:
            client.start()
            client.join(timeout=5)
            assert not answers, f"answered during an open update: {answers}"
        finally:
            close()
        client.join(timeout=wait_s)
        sender.close()
    finally:
        ray.get(engine.set_keep_previous.remote(False), timeout=120)
    assert answers, f"no answer {wait_s:g} s after the update was closed: the server stayed paused"
    status, out = answers[0]
    assert status == 200, out
    tokens, tag = hammer.parse(out)
    assert [tokens] == want
    return time.monotonic() - begun, tag


def check_a_half_written_update_is_refused_to_the_servers_clients(
    engine, trainer, hammer: Hammer, engine_name: str, name: str
) -> None:
    """An update that loaded a tensor and was aborted (no keep_previous: the weights stay partly
    written) leaves the server refusing its own clients: a request sent straight to it is
    answered 503 with the reason, as is a second one; the next sync (verified) ends that, and
    the server answers as the trainer's reference. `engine_name`: "vllm" or "sglang";
    `name`: the engine's name in the trainer's `connect`."""
    from tests.engine_checks import half_update

    ray.get(engine.set_keep_previous.remote(False), timeout=120)
    prompt = prompt_ids()[0]
    half_update(engine, trainer.call("refit_info")[0], version="half-written")
    for _ in range(2):
        status, out = hammer.ask(prompt)
        assert status == 503, (status, out)
        want = f"{engine_name} engine does not serve: update 'half-written' was aborted"
        assert want in out["error"], out
    report = trainer.call("sync", "after-half-written", verify=True)
    assert report["verify"][name]["verified"], report["verify"]
    want_tokens = trainer.call("reference_generate", [prompt], max_new_tokens=MAX_NEW_TOKENS)[
        "tokens"
    ]
    status, out = hammer.ask(prompt)
    assert status == 200, out
    assert [hammer.parse(out)[0]] == want_tokens


def check_probes_through_the_gate(
    engine,
    model: str,
    worker: str,
    served: Callable[[], list[list[int]]],
    trainer: Any,
) -> None:
    """Two trainers that probe sync into the engine's HTTP server: the probe's request alone
    passes weightsync's gate while the update is open. First `trainer` (the module's, already
    connected) syncs random weights into the server, so that it does not serve the
    checkpoint's, which the probing trainers hold (as when this runs first in its module). A bound below the float32 gap between
    the trainer's forward and the engine's fails the probe: rolled back (keep_previous), the
    server keeps serving what it served (`served()`: the greedy tokens of `prompt_ids()`, asked
    of the server directly); a sound bound passes (a mean gap below 1e-3; its greedy decode
    steps, requests of their own, passed the gate too), and the server then serves the
    trainer's weights."""
    from weightsync.driver import launcher

    trainer.call("set_weights_from", 321)
    trainer.sync("before-probes")
    before = served()
    version = ray.get(engine.weight_version.remote())
    outcomes: dict[str, Any] = {}
    for name, bound in (("too-tight", 1e-9), ("probed", 1e-3)):
        prober = launcher.TrainerGroup(
            worker,
            model_path=model,
            world_size=1,
            bucket_bytes=1 << 20,
            seed=77,
            keep_previous=True,
            probe={"bound": bound, "length": 24},
        )
        try:
            prober.call("connect", {name: engine})
            try:
                outcomes[name] = prober.sync(f"{name}-1")
            except Exception as exc:  # noqa: BLE001 - asserted below
                outcomes[name] = f"{type(exc).__name__}: {exc}"
            outcomes[f"{name}-served"] = served()
            outcomes[f"{name}-version"] = ray.get(engine.weight_version.remote())
            want = prober.call("reference_generate", prompt_ids(), max_new_tokens=MAX_NEW_TOKENS)
            outcomes[f"{name}-want"] = want["tokens"]
        finally:
            prober.kill()
    failed = outcomes["too-tight"]
    assert isinstance(failed, str) and "ProbeFailed" in failed, failed
    assert "update 'too-tight-1' failed the log-prob probe" in failed
    assert outcomes["too-tight-version"] == version
    assert outcomes["too-tight-served"] == before  # rolled back, its prefix cache reset
    report = outcomes["probed"]
    assert not isinstance(report, str), report
    probed = report.engines["probed"]
    assert probed.probe_gap is not None and 0 < probed.probe_gap < 1e-3, probed
    assert probed.probe_decode_steps == 8, probed  # its decode steps passed the gate too
    assert outcomes["probed-version"] == "probed-1"
    served_now, want = outcomes["probed-served"], outcomes["probed-want"]
    assert served_now == want != before, {"served": served_now, "want": want, "before": before}


TIE_NATS = 1e-3  # a token this close to the most likely one may be chosen either way


def check_version_spans(
    hammer: Hammer,
    refs: list[list[list[int]]],
    margins_on: Callable[[int, list], list],
    *,
    forward: bool = True,
) -> dict[str, Any]:
    """Answers whose tag is the JSON of their version spans [[version index, start, end], ...]
    (each token's weight version, as the engine reports it): every span computed on its
    version from the prompt and the tokens before it. A span from the start equals that
    version's reference (`refs[v][prompt]`). A later one (the request was in flight across a
    switch, and went on from its tokens so far on the new weights), and a first span that
    differs from the reference ("ties"), holds, at each position, a greedy choice of that
    version given the tokens before it: `margins_on(v, [(prompt +
    tokens up to the span's end, where the span starts in it), ...])` answers how far each
    token's log-prob falls below the most likely one's (`reference_margins`), and none may
    be above `TIE_NATS` (a near tie, which float32 rounding may tip either way). With
    `forward` a later span's version must come after the one before it; without (a revert
    goes back), only differ from it. Returns the counts ("switched": answers with more than
    one span)."""
    import json

    prompts = prompt_ids()
    complete = [a for a in hammer.answers if a.outcome == "complete"]
    bad: list[str] = []
    later: dict[int, list[tuple[Answer, int, int]]] = {}  # version -> (answer, start, end)
    switched = ties = 0
    for a in complete:
        assert a.tokens is not None and a.tag is not None, a
        spans = json.loads(a.tag)
        pairs = list(zip(spans, spans[1:]))
        if (
            not spans
            or min(s[0] for s in spans) < 0
            or spans[0][1] != 0
            or spans[-1][2] != len(a.tokens)
            or any(x[2] != y[1] or (y[0] <= x[0] if forward else y[0] == x[0]) for x, y in pairs)
        ):
            bad.append(
                f"prompt {a.prompt}: spans {spans} (-1: a version not asked of) do not cover "
                f"{len(a.tokens)} tokens"
            )
            continue
        switched += len(spans) > 1
        v, _, end = spans[0]
        if a.tokens[:end] != refs[v][a.prompt][:end]:
            # Not the reference: each token must still be a greedy choice of version v, up to
            # a near tie that the engine's reduction order (TP > 1 sums partial GEMMs) tips.
            ties += 1
            later.setdefault(v, []).append((a, 0, end))
        for v, start, end in spans[1:]:
            later.setdefault(v, []).append((a, start, end))
    for v, items in later.items():
        asks = [
            (prompts[a.prompt] + a.tokens[:end], len(prompts[a.prompt]) + start)
            for a, start, end in items
        ]
        for (a, start, end), margins in zip(items, margins_on(v, asks)):
            if max(margins) > TIE_NATS:
                bad.append(
                    f"prompt {a.prompt}: tokens {start}..{end} of {a.tokens} (spans {a.tag}) "
                    f"are not version {v}'s greedy choices: margins {margins}"
                )
    counts = {"complete": len(complete), "switched": switched, "ties": ties, "bad": len(bad)}
    print(f"answers: {counts}")
    failures = [a.outcome for a in hammer.answers if a.outcome != "complete"]
    assert not bad, f"{len(bad)} of {len(complete)} answers: {bad[:3]}"
    assert not failures, f"{len(failures)} requests did not complete: {failures[:3]}"
    return counts


def _inside(answers: list[Answer], windows: list[tuple[float, float]]) -> list[Answer]:
    """Answers served during staging: answered while a sync ran (`windows[k]`, the sync that
    brings version k + 1), every token tagged by the engine with the version it served before
    that sync (k), so computed before its switch. (Not "sent and answered inside a sync": on a
    machine where an answer takes longer than a sync, none would be.)"""
    import json

    def staged_under(a: Answer, k: int, lo: float, hi: float) -> bool:
        if a.outcome != "complete" or not a.tag or not lo <= a.done_s <= hi:
            return False
        return all(span[0] == k for span in json.loads(a.tag))

    return [
        a for a in answers if any(staged_under(a, k, lo, hi) for k, (lo, hi) in enumerate(windows))
    ]


def _seen_inside_and_across(hammer: Hammer, windows: list[tuple[float, float]]) -> bool:
    """Whether some answer so far came while a sync staged, and some (by its version spans,
    the engine's own tags) was in flight across a switch."""
    import json

    answers = list(hammer.answers)
    across = any(a.outcome == "complete" and a.tag and len(json.loads(a.tag)) > 1 for a in answers)
    return bool(_inside(answers, windows)) and across


def check_staged_syncs_under_requests(
    engine,
    model: str,
    worker: str,
    spans_hammer: Callable[[Any, dict[str, int]], Hammer],
    *,
    syncs: int = STAGED_SYNCS,
    **trainer_args: Any,
) -> None:
    """A trainer (`worker` ranks, `trainer_args` over 64 KiB buckets) with `staged=True` syncs
    verified versions of random weights into `engine` while `spans_hammer(engine, {version
    tag: index})`'s clients call its server: every answer's version spans are checked
    (`check_version_spans`), some answer must come while a sync stages and some must cross a
    switch; each sync reports its one pause (`pause_s`) and when it switched. It syncs until
    both were seen, at least `MIN_STAGED_SYNCS` times and at most `syncs` (how many a window
    of a sync holds an answer depends on the machine's speed). Prints the counts and the
    pauses."""
    from weightsync.driver import launcher

    first_seed = 2000
    # Each engine call may wait for the server's step under the clients' load: on a slow,
    # shared two-core machine a staged sync's `begin` went unanswered past the default 60 s once.
    args: dict[str, Any] = {"bucket_bytes": 1 << 16, "seed": 0, "timeout_s": 240, **trainer_args}
    # A sync past 10 minutes fails the test naming the call and each rank (GroupCall).
    trainer = launcher.TrainerGroup(
        worker, model_path=model, staged=True, verify=True, call_timeout_s=600, **args
    )
    try:
        trainer.call("connect", {"staged": engine})
        ids = prompt_ids()
        trainer.call("set_weights_from", first_seed)
        trainer.call("sync", "s0")
        refs = []
        for i in range(syncs + 1):
            trainer.call("set_weights_from", first_seed + i)
            refs.append(
                trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)["tokens"]
            )
        hammer = spans_hammer(engine, {f"s{i}": i for i in range(syncs + 1)})
        reports, windows = [], []
        hammer.start()
        try:
            time.sleep(1)
            for i in range(1, syncs + 1):
                trainer.call("set_weights_from", first_seed + i)
                start = time.monotonic()
                reports.append(trainer.call("sync", f"s{i}"))
                windows.append((start, time.monotonic()))
                # a failed run's last lines say how far it came (tests/conftest.py)
                print(
                    f"staged sync s{i} done in {windows[-1][1] - start:.2f} s; "
                    f"{len(hammer.answers)} answers so far",
                    flush=True,
                )
                time.sleep(0.2)
                if i >= MIN_STAGED_SYNCS and _seen_inside_and_across(hammer, windows):
                    break
            time.sleep(1)
        finally:
            hammer.stop()

        def margins_on(version: int, asks: list) -> list:
            trainer.call("set_weights_from", first_seed + version)
            return trainer.call(
                "reference_margins", [seq for seq, _ in asks], [start for _, start in asks]
            )

        counts = check_version_spans(hammer, refs, margins_on)
    finally:
        trainer.kill()
    for report in reports:
        part = report["engines"]["staged"]
        assert report["verify"]["staged"]["verified"], report["verify"]
        assert part["path"] == "buckets" and part["pause_s"] > 0 and part["switched_at"] > 0
    inside = _inside(hammer.answers, windows)
    for report in reports:  # where a slow sync's time went
        part = report["engines"]["staged"]
        times = {k: part.get(k) for k in ("load_s", "end_s", "session_s", "pause_s")}
        print(f"staged sync {report['version']}: sync_s {report['sync_s']:.3f}, engine {times}")
    pauses = sorted(r["engines"]["staged"]["pause_s"] for r in reports)
    syncs = sorted(r["sync_s"] for r in reports)
    print(
        f"staged: {counts}; {len(reports)} syncs; {len(inside)} answers inside a sync; sync_s median "
        f"{syncs[len(syncs) // 2]:.3f} s; pause_s median {pauses[len(pauses) // 2] * 1e3:.1f} ms, "
        f"max {pauses[-1] * 1e3:.1f} ms"
    )
    assert inside, "no request was answered while a sync was staging"
    assert counts["switched"] > 0, "no request was in flight across a switch: nothing checked"


def check_a_revert_under_requests(
    engine,
    model: str,
    worker: str,
    name: str,
    spans_hammer: Callable[[Any, dict[str, int]], Hammer],
) -> None:
    """A trainer (`worker`) with `staged=True, keep_previous=True` syncs two verified versions
    into `engine` (as `name`), then `TrainerSync.revert` puts the first back while
    `spans_hammer`'s clients call its server: every answer's tokens are those of the versions
    the engine tags them with (a request in flight across the revert goes on, on the first
    version again), some answer overlaps the revert, every one sent after it is the first
    version's alone, and a second revert is refused, naming why. The engine keeps
    `keep_previous` on afterwards."""
    from weightsync.driver import launcher

    seeds = [3000, 3001]
    trainer = launcher.TrainerGroup(
        worker,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        staged=True,
        verify=True,
        keep_previous=True,
    )
    try:
        trainer.call("connect", {name: engine})
        ids = prompt_ids()
        refs = []
        for i, seed in enumerate(seeds):
            trainer.call("set_weights_from", seed)
            assert trainer.sync(f"back-{i}").verify[name].verified
            refs.append(
                trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)["tokens"]
            )
        assert refs[0] != refs[1], "two versions alike: nothing shown"
        hammer = spans_hammer(engine, {f"back-{i}": i for i in range(len(seeds))})
        hammer.start()
        try:
            time.sleep(1)
            start = time.monotonic()
            reverted = trainer.call("revert")[name]
            end = time.monotonic()
            time.sleep(1)
        finally:
            hammer.stop()
        assert reverted["weight_version"] == "back-0" and reverted["pause_s"] > 0, reverted
        assert ray.get(engine.weight_version.remote(), timeout=120) == "back-0"

        def margins_on(version: int, asks: list) -> list:
            trainer.call("set_weights_from", seeds[version])
            return trainer.call(
                "reference_margins", [seq for seq, _ in asks], [at for _, at in asks]
            )

        counts = check_version_spans(hammer, refs, margins_on, forward=False)
        with pytest.raises(Exception, match="nothing to revert"):
            trainer.call("revert")
    finally:
        trainer.kill()
    across = [a for a in hammer.answers if a.sent_s < end and a.done_s > start]
    after = [a for a in hammer.answers if a.sent_s > end]
    print(
        f"revert: {counts}; {len(across)} answers overlap it; pause {reverted['pause_s'] * 1e3:.1f} ms"
    )
    assert across, "no request was in flight during the revert: nothing checked"
    assert after and all(json.loads(a.tag or "[]")[0][0] == 0 for a in after), [
        a.tag for a in after
    ]


def check_a_failed_staged_sync_is_seen_by_no_request(
    engine, trainer, name: str, hammer: Hammer, served: list[list[int]]
) -> None:
    """`hammer`'s clients (tagging the served version as index 0) call the server while a
    staged, verified sync whose check fails is aborted before the switch
    (`check_failed_verification_is_never_adopted`): every answer, before, during and after it,
    is the served version's (`served`: its greedy tokens of `prompt_ids()`), tagged so."""
    from tests.engine_checks import check_failed_verification_is_never_adopted

    hammer.start()
    try:
        time.sleep(0.5)
        check_failed_verification_is_never_adopted(engine, trainer, name, staged=True)
        time.sleep(0.5)
    finally:
        hammer.stop()

    def margins_on(v: int, asks: list) -> list:
        raise AssertionError(f"an answer switched to version {v} mid-request: {asks}")

    counts = check_version_spans(hammer, [served], margins_on)
    assert counts["complete"] > 0 and counts["switched"] == 0


def check_a_staged_sync_failing_its_probe_is_seen_by_no_request(
    engine,
    model: str,
    worker: str,
    name: str,
    hammer: Hammer,
    served: list[list[int]],
    version: Callable[[], Any],
) -> None:
    """`hammer`'s clients (tagging the served version as index 0) call the server while a
    trainer (`worker`) with `staged=True, keep_previous=True` and a probe no engine passes (a
    mean bound of 1e-12 nats: the failure planted on the trainer's side, so the engine really
    switches to the new weights before its probe fails) syncs new weights: the server holds its
    clients from before the switch until the engine is switched back, so the sync fails on its
    probe and every answer, before, during and after it, is the served version's (`served`:
    its greedy tokens of `prompt_ids()`), tagged so; `version()` is unchanged. The engine
    keeps `keep_previous` on afterwards."""
    from weightsync.driver import launcher

    before = version()
    trainer = launcher.TrainerGroup(
        worker,
        model_path=model,
        bucket_bytes=1 << 20,
        seed=0,
        staged=True,
        verify=True,
        keep_previous=True,
        probe={"bound": 1e-12, "max_bound": None},
    )
    try:
        trainer.call("connect", {name: engine})
        trainer.call("set_weights_from", 3100)  # a version unlike the served one
        hammer.start()
        try:
            time.sleep(0.5)
            start = time.monotonic()
            with pytest.raises(Exception, match="failed the log-prob probe") as caught:
                trainer.sync("probe-fails")
            end = time.monotonic()
            time.sleep(0.5)
        finally:
            hammer.stop()
    finally:
        trainer.kill()
    assert f"probed after its switch: it serves {before!r} again" in str(caught.value), str(
        caught.value
    )[:2000]
    assert version() == before

    def margins_on(v: int, asks: list) -> list:
        raise AssertionError(f"an answer switched to version {v} mid-request: {asks}")

    counts = check_version_spans(hammer, [served], margins_on)
    across = [a for a in hammer.answers if a.sent_s < end and a.done_s > start]
    print(f"a staged sync failing its probe: {counts}; {len(across)} answers overlap it")
    assert counts["complete"] > 0 and counts["switched"] == 0 and across
