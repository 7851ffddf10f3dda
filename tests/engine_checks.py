"""Checks shared by the engine suites: what "the engine serves the trainer's weights" means."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import ray

from weightsync.apps.models import make_tokenizer
from weightsync.wire.protocol import SyncReport

PROMPTS = ["The quick brown fox", "weightsync keeps engines", "Once upon a time"]
MAX_NEW_TOKENS = 8


def prompt_ids() -> list[list[int]]:
    tok = make_tokenizer()
    return [tok(p).input_ids for p in PROMPTS]


def assert_engine_matches_reference(engine, trainer, *, logprob_tol: float = 1e-3) -> None:
    """Greedy tokens equal the trainer's float32 transformers reference; logprobs close."""
    ids = prompt_ids()
    want = trainer.call("reference_generate", ids, max_new_tokens=MAX_NEW_TOKENS)
    got = ray.get(engine.generate.remote(ids, max_new_tokens=MAX_NEW_TOKENS), timeout=300)
    assert got["tokens"] == want["tokens"]
    for g_row, w_row in zip(got["logprobs"], want["logprobs"]):
        for g, w in zip(g_row, w_row):
            assert math.isclose(g, w, abs_tol=logprob_tol), (g_row, w_row)


def training_batch(step: int) -> list[list[int]]:
    tok = make_tokenizer()
    text = f"step {step}: the engines follow the trainer, bucket by bucket."
    return [tok(text).input_ids[:48]] * 2


def check_sync_after_training(
    engine, trainer, name: str, version: str, *, steps: int
) -> SyncReport:
    """Train, sync with verification, then the engine serves exactly the trainer's weights."""
    for step in range(steps):
        trainer.call("train_step", training_batch(step))
    report = trainer.sync(version, verify=True)
    assert report.verify is not None and report.verify[name].verified, report.verify
    assert report.verify[name].num_checked > 10
    assert ray.get(engine.weight_version.remote()) == version
    # Compared once the engine's background work is done: vLLM on CPU re-packs its GEMM weights
    # after `end`, and a generation during the re-pack mixes two GEMM implementations (same
    # weights, other rounding), where a near-tie can flip a greedy token of this trained model.
    # Serving right after a sync is checked by `check_repeated_syncs`.
    ray.get(engine.settle.remote(), timeout=300)
    assert_engine_matches_reference(engine, trainer)
    return report


def check_repeated_syncs(
    engine, trainer, name: str, prefix: str, *, rounds: int, path: str = "buckets"
) -> None:
    """Several syncs of very different weights, with requests served in between; each takes
    `path` ("one_copy": the trainer writes into the engine's shared parameters)."""
    before = ray.get(engine.generate.remote(prompt_ids()))
    for round_ in range(rounds):
        trainer.call("set_weights_from", 100 + round_)
        report = trainer.sync(f"{prefix}-{round_}", verify=True)
        assert report.engines[name].path == path, report
        assert report.verify is not None and report.verify[name].verified
        out = ray.get(engine.generate.remote(prompt_ids()))
        assert out["weight_version"] == f"{prefix}-{round_}"
        assert_engine_matches_reference(engine, trainer)
    assert out["tokens"] != before["tokens"]


def check_server_on_loopback_demands_key(
    engine, paths: list[str], *, key: str, get_path: str
) -> None:
    """The server listens on 127.0.0.1; a POST to each of `paths` without a key or with another
    key is answered 401; a GET of `get_path` with `key` is answered 200; the key is on no
    process's command line (readable by every local user) and in no log of the Ray session."""
    import urllib.error
    import urllib.request

    import psutil
    import pytest

    base = ray.get(engine.server_url.remote())
    assert base.startswith("http://127.0.0.1:")
    for path in paths:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            req = urllib.request.Request(
                base + path,
                data=b"{}",
                method="POST",
                headers={"Content-Type": "application/json", **headers},
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 401, (path, headers)
    req = urllib.request.Request(base + get_path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    shown = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(key in arg for arg in (p.info["cmdline"] or ()))
    ]
    assert shown == [], f"the server's key is on the command line of processes {shown}"
    # Nor in any log of this Ray session (every actor's and the server's output lands there).
    from pathlib import Path

    from ray._private.worker import _global_node

    logs = Path(_global_node.get_session_dir_path()) / "logs"
    leaked = [str(p) for p in logs.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == [], f"the server's key is in the logs {leaked}"


def load_random(engine, spec: dict) -> Any:
    """Load one tensor of random float32 values (`spec`, from refit info) as a bucket into the
    engine's open update; returns the sender holding its memory (the caller closes it)."""
    import torch

    from weightsync.transports.shm import ShmSender
    from weightsync.wire.specs import TensorMeta

    sender = ShmSender(num_slots=1)
    try:
        meta = TensorMeta(
            name=spec["name"], dtype=spec["dtype"], shape=tuple(spec["shape"]), offset=0
        )
        buf = sender.buffer(0, meta.nbytes)
        buf.view(torch.float32).copy_(torch.randn(buf.numel() // 4))
        descriptor = {
            "index": 0,
            "nbytes": meta.nbytes,
            "handle": sender.handle(0),
            "tensors": [meta.to_dict()],
        }
        ray.get(engine.load_bucket.remote(descriptor), timeout=300)
    except BaseException:
        sender.close()
        raise
    return sender


def half_update(engine, spec: dict, version: str = "half") -> None:
    """Begin an update, load one tensor of random float32 values (`spec`, from refit info),
    then abort it, as a sender that died mid-sync would leave it."""
    ray.get(engine.begin.remote(version))
    sender = load_random(engine, spec)  # one tensor in, then the sender "dies"
    try:
        ray.get(engine.abort.remote("sender failed"))
    finally:
        sender.close()


def check_failed_verification_is_never_adopted(
    engine,
    trainer,
    name: str,
    *,
    staged: bool = False,
    replicas: dict | None = None,
    learn_first: bool = False,
) -> None:
    """Stage, verify, commit, against a real engine: a verified sync (new random weights for
    every tensor, from a sender in this process) whose check fails is aborted before `end`.
    The failure is planted on the trainer's side (it expects other bytes for one tensor),
    so the engine really holds the staged weights when it is checked; with keep_previous it
    then puts back its previous weights and goes on serving them, same version and answers.
    `staged`: a staged sync (`begin(..., staged=True)`), without keep_previous: the served
    weights were never written. `replicas` ({name: engine}): more engines in the same sync;
    one engine's failed check aborts it for all, and none of them adopts it. `learn_first`: a
    verified sync first (from a list, which the sender reads again to check the workers of a
    tensor-parallel engine before they adopt it), so that the failing sync knows where each
    worker keeps each tensor and checks every engine, each worker included: the failure is
    then every engine's own, the tensor-parallel one's too."""
    import pytest
    import torch

    from weightsync.trainer.endpoint import RayEndpoint
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.verify import SentTable
    from weightsync.transports.shm import ShmSender
    from weightsync.wire.errors import VerificationFailed
    from weightsync.wire.specs import dtype_from_str, specs_from_dicts

    everyone = {name: engine, **(replicas or {})}
    specs = specs_from_dicts(trainer.call("refit_info"))
    target = next(
        s.name for s in specs if s.name.endswith("fc1.weight") or s.name.endswith("up_proj.weight")
    )
    module = target.rsplit(".", 2)[0] + "."  # its layer's parameters: fc1, gate_up_proj

    def random_tensors(seed: int) -> list:
        gen = torch.Generator().manual_seed(seed)
        return [
            (s.name, (torch.randn(s.shape, generator=gen) * 0.1).to(dtype_from_str(s.dtype)))
            for s in specs
        ]

    sender = WeightSender(specs, transport=ShmSender(), capacity_bytes=1 << 20, staged=staged)
    for n, e in everyone.items():
        sender.add_engine(RayEndpoint(e, name=n))
    if learn_first:
        first = sender.sync(random_tensors(122), version="before-never-adopted", verify=True)
        assert all(first.verify[n].verified for n in everyone), first.verify
    before = {}
    for n, e in everyone.items():
        ray.get(e.settle.remote(), timeout=300)
        before[n] = (
            ray.get(e.weight_version.remote()),
            ray.get(e.fingerprints.remote()),
            ray.get(e.generate.remote(prompt_ids()))["tokens"],
        )
    tensors = random_tensors(123)
    seen: dict = {}
    check, stage_all = sender.verifier.check_staged, sender.verifier.stage_all

    def off(sent, worker_sent):
        table = sent.table.clone()  # the sent fingerprints (`SentTable`), one of them off
        table[sent.names.index(target), 0] += 1
        workers_off = {  # and, per worker of a tensor-parallel engine, what the target lands in
            engine: [
                {
                    p: (f[0] + 1, *f[1:])
                    if p.startswith(module) and ("up" in p or "fc1" in p)
                    else f
                    for p, f in prints.items()
                }
                for prints in workers
            ]
            for engine, workers in (worker_sent or {}).items()
        }
        return SentTable(sent.names, table), workers_off

    def planted_stage(version, names, sent, *, worker_sent=None):
        # The digests `stage` is sent are made from the same planted expectation.
        table, workers_off = off(sent, worker_sent)
        return stage_all(version, names, table, worker_sent=workers_off)

    def planted(staged, sent, *, worker_sent=None, **kwargs):
        seen.update(staged)
        table, workers_off = off(sent, worker_sent)
        return check(staged, table, worker_sent=workers_off, **kwargs)

    sender.verifier.stage_all = planted_stage
    sender.verifier.check_staged = planted
    if not staged:  # a staged update never writes the served weights: nothing to keep
        for e in everyone.values():
            ray.get(e.set_keep_previous.remote(True))
    try:
        with pytest.raises(
            VerificationFailed, match="'never-adopted' aborted before any engine"
        ) as caught:
            sender.sync(iter(tensors), version="never-adopted", verify=True)
        if learn_first:  # every engine checked, and every one failed its own check
            failed = caught.value.results
            assert all(failed[n]["mismatched"] for n in everyone), failed
    finally:
        if not staged:
            for e in everyone.values():
                ray.get(e.set_keep_previous.remote(False))
        sender.close()
    for n, e in everyone.items():
        version, prints, served = before[n]
        held = seen[n].fingerprints[0]
        assert any(held[p] != prints[p] for p in prints), n  # checked holding the new bytes
        assert ray.get(e.weight_version.remote()) == version, n
        assert ray.get(e.fingerprints.remote()) == prints, n
        assert ray.get(e.generate.remote(prompt_ids()))["tokens"] == served, n


@contextlib.contextmanager
def open_json_server(routes: dict[str, object], *, key: str | None = None):
    """A loopback HTTP server that answers GET `path` with `routes[path]` as JSON, POST `path`
    with `routes["POST " + path]` (404 elsewhere): to anyone without `key` (what a server
    started without an API key looks like to weightsync's attach checks), else 401 to a request
    without `Bearer <key>` but on /health. Yields its base URL."""
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(routes.get("POST " + self.path))

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self._answer(routes.get(self.path))

        def _answer(self, body: object) -> None:
            authorized = self.headers.get("Authorization") == f"Bearer {key}"
            if key is not None and self.path != "/health" and not authorized:
                body = None
                self.send_response(401)
                self.end_headers()
                return
            data = json.dumps(body).encode()
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
