"""`weightsync demo`: one trainer group keeps an SGLang and a vLLM engine in step, in one Ray job.

Who runs where: the driver and the 2 trainer ranks (DTensorV2WeightSyncWorker, FSDP2 over gloo)
run in the root environment, which has neither engine; the SGLang engine actor runs in env
"sglang", the vLLM engine actor in "vllm-cpu" (or "vllm" on a GPU machine). What crosses between
them: bucket descriptors and reports as plain dicts over Ray, and raw bytes in shared memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

TEXT = "weightsync keeps every engine in step with the trainer. "


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a tiny model and keep SGLang and vLLM in step")
    p.add_argument("--steps", type=int, default=30, help="training steps, each followed by a sync")
    p.add_argument("--engines", default="sglang,vllm", help="comma-separated: sglang, vllm")
    p.add_argument("--model-size", default="tiny", help="tiny, small, base or medium")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--plot", metavar="FILE.png", help="draw loss and sync times over steps")
    p.set_defaults(run=run)


def _continuation(tokens: list[int]) -> str:
    from weightsync.models import make_tokenizer

    return make_tokenizer().decode(tokens)


def run(args: argparse.Namespace) -> int:
    import ray

    from weightsync import envs, launcher
    from weightsync.models import make_tiny_model, make_tokenizer

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("sglang", "vllm")]
    if bad or not engines:
        raise ValueError(f"--engines {args.engines!r}: expected a list of sglang, vllm")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    log = logging.getLogger("weightsync.demo")
    for name in engines:
        env = "sglang" if name == "sglang" else envs.default_vllm_env()
        log.info("env %s: %s", env, envs.build(env)["action"])
    model = make_tiny_model(tempfile.mkdtemp(prefix="weightsync-demo-"), arch="opt",
                            size=args.model_size, seed=0)
    tok = make_tokenizer()
    prompt = tok("weightsync keeps").input_ids
    batch = [tok(TEXT * 3).input_ids[:96]] * 2
    launcher.init_ray(num_cpus=2, log_to_driver=False)
    actors = {
        "sglang": lambda: launcher.launch("weightsync.backends.sglang.engine.SglEngineActor", model),
        "vllm": lambda: launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model),
    }
    handles = {name: actors[name]() for name in engines}
    trainer = launcher.TrainerGroup("weightsync.worker.DTensorV2WeightSyncWorker",
                                    model_path=model, lr=2e-3, seed=0)
    _wait_for_engines(handles)
    trainer.call("connect", handles)
    steps: list[dict[str, Any]] = []
    ok = True
    table = Table("step", "loss", *[c for n in engines
                                     for c in (f"{n} ms", "GB/s", "ok", f"{n} continuation")])
    console = Console()
    live = Live(table, console=console, auto_refresh=False)
    if not args.json:
        live.start()
    for step in range(1, args.steps + 1):
        loss = trainer.call("train_step", batch)
        report = trainer.call("sync", f"step-{step}", verify=True)
        want = trainer.call("reference_generate", [prompt], max_new_tokens=24)["tokens"][0]
        row: dict[str, Any] = {"step": step, "loss": loss, "engines": {}}
        for name, handle in handles.items():
            got = ray.get(handle.generate.remote([prompt], max_new_tokens=24), timeout=300)
            verified = bool(report["verify"][name]["verified"])
            same = got["tokens"][0] == want
            ok &= verified and same
            engine_s = report["engines"][name].get("session_s", report["sync_s"])
            row["engines"][name] = {"verified": verified, "matches_reference": same,
                                    "sync_s": engine_s, "gbps": report["nbytes"] / engine_s / 1e9,
                                    "text": _continuation(got["tokens"][0])}
        steps.append(row)
        table.add_row(str(step), f"{loss:.3f}", *[c for e in row["engines"].values() for c in (
            f"{e['sync_s'] * 1e3:.1f}", f"{e['gbps']:.2f}",
            "yes" if e["verified"] and e["matches_reference"] else "NO", repr(e["text"][:28]))])
        live.refresh()
    if not args.json:
        live.stop()
        console.line()
    summary = {"ok": ok, "steps": steps, "reference": _continuation(want)}
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print(f"reference continuation: {summary['reference'][:60]!r}")
        print("every sync verified and every engine matched the trainer" if ok
              else "FAILED: a sync did not verify or an engine differed from the trainer")
    if args.plot:
        _plot(steps, args.plot)
    for handle in handles.values():
        try:
            ray.get(handle.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
    ray.shutdown()
    time.sleep(0.1)
    return 0 if ok else 1


def _wait_for_engines(handles: dict[str, Any]) -> None:
    """Engines take a minute or two to start on a CPU: show each one's state and elapsed time
    (on stderr) until all answer; an engine that died raises its error here."""
    import ray

    start = time.monotonic()
    pending = {name: handle.weight_version.remote() for name, handle in handles.items()}
    ready: dict[str, float] = {}

    def status() -> Text:
        now = time.monotonic() - start
        return Text("  ".join(f"{n}: ready after {ready[n]:.0f} s" if n in ready
                              else f"{n}: starting, {now:.0f} s" for n in handles))

    with Live(status(), console=Console(stderr=True), refresh_per_second=2) as live:
        while pending:
            done, _ = ray.wait(list(pending.values()), timeout=0.5)
            for name, ref in list(pending.items()):
                if ref in done:
                    ray.get(ref)
                    ready[name] = time.monotonic() - start
                    del pending[name]
            live.update(status())


def _plot(steps: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_sync) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [s["step"] for s in steps]
    ax_loss.plot(xs, [s["loss"] for s in steps], marker="o")
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    for name in steps[0]["engines"]:
        ax_sync.plot(xs, [s["engines"][name]["sync_s"] * 1e3 for s in steps], marker="o",
                     label=name)
    ax_sync.set(xlabel="step", ylabel="sync ms", title="sync time per engine")
    ax_sync.legend()
    fig.tight_layout()
    fig.savefig(path)
