"""How long a client's request goes without progress while a trainer syncs engines' HTTP servers:
today's syncs (generation paused from `begin` to `end`) beside staged ones (`SyncOptions.staged`:
the engines serve while the sync loads into a second copy, then switch in one short pause),
measured in one run on the same engines.

  python scripts/stall_bench.py                   # one engine, TP=1
  python scripts/stall_bench.py --replicas 2      # two engines, each sync into both
  python scripts/stall_bench.py --tp 2            # one engine of two TP workers
  python scripts/stall_bench.py --engine sglang   # SGLang's server (TP=1 on a CPU)
  python scripts/stall_bench.py --replicas 2 --phases staged,timed   # switch instant or not

Clients (`--clients` threads per engine) stream greedy completions of `--tokens` tokens from
/v1/completions ("stream": true) without pause. A request's stall is the longest time it went
without a new token: from being sent to its first token, or between two tokens. Three phases of
`--seconds` each, on the same engines: none (no sync), paused (a trainer syncing back to back
with a 0.2 s gap, as today: its first sync by buckets, then the one-copy path), staged (another
trainer, `staged=True`, by buckets, each engine switching when its `end` arrives:
`switch_lead_s=0`), and with `--phases` timed (`staged=True` with `switch_lead_s=--lead`: the
engines switch at one instant the trainer names). For each phase: the requests whose life overlapped a sync,
their longest stall, the 99th percentile, the median gap between tokens over all requests; and
from the sync reports, how long each engine held generation (paused: from its `begin` to the end
of its `end`, `session_s`, which includes the wait for the requests in flight to finish; staged:
its switch, `pause_s`, measured by the server around it) and the skew between the replicas'
switches (`SyncReport.switch_skew_s`), and the staged pause in its parts (`pause_parts`: until the
engine stopped generating, its cache reset, the parameters written, the version tag, the resume). The "none" phase is the floor: on a 2-core machine
shared by the engine, the trainer and the clients, a request can stall without any sync. The model is a tiny
random one made here (`--arch`); every time is wall-clock on this host, the clients' own HTTP
and JSON work included.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

ACTORS = {  # engine: (its actor, the trainer ranks' worker)
    "vllm": (
        "weightsync.backends.vllm.engine.VllmEngineActor",
        "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
    ),
    "sglang": (
        "weightsync.backends.sglang.engine.SglEngineActor",
        "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
    ),
}
PROMPTS = ["The quick brown fox", "weightsync keeps engines", "Once upon a time"]


@dataclass(slots=True)
class Request:
    sent: float
    times: list[float] = field(default_factory=list)  # each token's arrival

    def stall(self) -> float:
        marks = [self.sent, *self.times]
        return max(b - a for a, b in zip(marks, marks[1:])) if self.times else 0.0


class Client(threading.Thread):
    """Streams completions of `prompt` from one server until stopped."""

    def __init__(self, base: str, key: str, model: str, prompt: list[int], tokens: int) -> None:
        super().__init__(daemon=True)
        url = urlparse(base)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.body = json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
        )
        self.requests: list[Request] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
            request = Request(sent=time.monotonic())
            conn.request("POST", "/v1/completions", self.body, self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"/v1/completions answered {response.status}")
            while line := response.readline():
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    request.times.append(time.monotonic())
            conn.close()
            self.requests.append(request)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ACTORS), default="vllm")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--arch", default="opt")
    parser.add_argument("--clients", type=int, default=2, help="streaming clients per engine")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--verify", action="store_true", help="verify every sync")
    parser.add_argument(
        "--worst", action="store_true", help="print each phase's worst request's timeline"
    )
    parser.add_argument(
        "--phases", default="none,paused,staged", help="of none, paused, staged, timed"
    )
    parser.add_argument("--lead", type=float, default=0.05, help="timed: switch_lead_s")
    args = parser.parse_args()

    import ray
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.models import make_tiny_model, make_tokenizer
    from weightsync.driver import launcher

    engine_actor, worker = ACTORS[args.engine]
    shape = (
        {"tensor_parallel_size": args.tp}
        if args.engine == "vllm"
        else {"engine_args": {"tp_size": args.tp}}
        if args.tp > 1
        else {}
    )
    model = make_tiny_model(tempfile.mkdtemp(prefix="stall-"), arch=args.arch, seed=0)
    launcher.init_ray(num_cpus=2)
    engines = {}
    for i in range(args.replicas):  # one after another: SGLang sizes its cache by free memory
        engines[f"e{i}"] = launcher.launch(engine_actor, model, mode="http", **shape)
        ray.get(engines[f"e{i}"].server_url.remote(), timeout=900)
    phases = args.phases.split(",")
    options = {
        "paused": {},
        "staged": {"staged": True, "switch_lead_s": 0.0},
        "timed": {"staged": True, "switch_lead_s": args.lead},
    }
    trainers = {
        name: launcher.TrainerGroup(
            worker, model_path=model, bucket_bytes=1 << 20, seed=0, verify=args.verify, **kw
        )
        for name, kw in options.items()
        if name in phases
    }
    for trainer in trainers.values():
        trainer.call("connect", engines)
    for name in trainers:  # the first syncs (by buckets, then sharing) before timing
        for i in range(2):
            trainers[name].call("sync", f"{name}-warm-{i}")
    tokenizer = make_tokenizer()
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    clients = []
    for engine in engines.values():
        base = ray.get(engine.server_url.remote())
        key = ray.get(engine.server_api_key.remote())
        for c in range(args.clients):
            clients.append(Client(base, key, model, prompts[c % len(prompts)], args.tokens))
    for client in clients:
        client.start()
    rows = []
    seed = 5000
    try:
        time.sleep(3)  # the clients' first requests (prefix cache, warm-up) before measuring
        for phase in phases:
            start = time.monotonic()
            windows: list[tuple[float, float]] = []
            reports: list[dict] = []
            while time.monotonic() - start < args.seconds:
                if phase == "none":
                    time.sleep(0.2)
                    continue
                seed += 1
                trainers[phase].call("set_weights_from", seed)
                begun = time.monotonic()
                reports.append(trainers[phase].call("sync", f"{phase}-{seed}"))
                windows.append((begun, time.monotonic()))
                time.sleep(0.2)
            end = time.monotonic()
            done = [r for c in clients for r in c.requests if start <= r.sent and r.times]
            done = [r for r in done if r.times[-1] <= end]
            overlapping = [
                r for r in done if any(lo <= r.times[-1] and r.sent <= hi for lo, hi in windows)
            ]
            measured = overlapping if phase != "none" else done
            stalls = [r.stall() for r in measured]
            if args.worst and measured:
                worst = max(measured, key=Request.stall)
                print(
                    f"{phase}: worst request, sent at {worst.sent - start:.3f} s: token times "
                    f"{[round(t - worst.sent, 3) for t in worst.times]}; syncs (start, end) "
                    f"{[(round(lo - worst.sent, 3), round(hi - worst.sent, 3)) for lo, hi in windows if lo <= worst.times[-1] and worst.sent <= hi]}"
                )
            gaps = [b - a for r in done for a, b in zip(r.times, r.times[1:])]
            # How long each engine held generation: a staged sync's switch, else begin to end.
            holds = [
                e.get("pause_s", e.get("session_s", 0.0))
                for rep in reports
                for e in rep["engines"].values()
            ]
            skews = [
                max(t) - min(t)
                for rep in reports
                if len(
                    t := [e["switched_at"] for e in rep["engines"].values() if "switched_at" in e]
                )
                > 1
            ]
            parts: dict[str, list[float]] = {}
            for rep in reports:
                for e in rep["engines"].values():
                    for part, seconds in (e.get("pause_parts") or {}).items():
                        parts.setdefault(part, []).append(seconds)
            rows.append(
                (
                    phase,
                    str(len(reports)),
                    f"{statistics.median([r['sync_s'] for r in reports]):.3f}" if reports else "-",
                    ",".join(sorted({r["path"] for r in reports})) or "-",
                    str(len(measured)),
                    f"{max(stalls, default=0) * 1e3:.0f}",
                    f"{_percentile(stalls, 0.99) * 1e3:.0f}",
                    f"{statistics.median(gaps) * 1e3:.1f}" if gaps else "-",
                    f"{statistics.median(holds) * 1e3:.1f} / {max(holds) * 1e3:.1f}"
                    if holds
                    else "-",
                    f"{statistics.median(skews) * 1e3:.1f} / {max(skews) * 1e3:.1f}"
                    if skews
                    else "-",
                    " ".join(f"{p} {statistics.median(v) * 1e3:.1f}" for p, v in parts.items())
                    or "-",
                )
            )
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.join(timeout=60)
        for trainer in trainers.values():
            trainer.kill()
        for engine in engines.values():
            ray.get(engine.shutdown.remote(), timeout=120)
        ray.shutdown()
    table = Table(
        title=f"stall while syncing: {args.engine}, {args.replicas} engine(s), TP={args.tp}, "
        f"{args.arch}, "
        f"{args.clients} streaming client(s) per engine, {args.tokens} tokens per request"
    )
    for column in (
        "phase",
        "syncs",
        "sync s (median)",
        "path",
        "requests",
        "max stall ms",
        "p99 stall ms",
        "token gap ms (median)",
        "engine held ms (median / max)",
        "switch skew ms (median / max)",
        "pause parts ms (median)",
    ):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
