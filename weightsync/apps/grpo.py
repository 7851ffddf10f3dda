"""GRPO with weightsync in the loop: engines sample, the FSDP2 trainer learns, every engine is synced.

One step (`GrpoLoop.step`): every engine samples `group_size` completions of each prompt with the
weights of the last sync; each completion gets a verifiable reward (`reward`: the share of its
byte tokens that are lowercase ASCII letters, which a randomly initialised byte-level model emits about
8% of the time, so the signal is dense from the first step); advantages are rewards normalised
within each group (same engine, same prompt); the trainer ranks recompute the float32
log-probabilities of the sampled tokens and take clipped policy-gradient steps on them
(`policy_step`, half the rollouts per rank); then one verified sync brings every engine to the
new version. The sampler-learner mismatch is measured on the recomputed log-probabilities of the
weights that sampled (before the update): mean |delta| and the k3 estimate of KL(sampler ||
learner), per engine.

`policy_step` runs inside the trainer ranks (torch); the rest runs in the driver, which imports
neither torch nor an engine.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from weightsync.engine.sampling import SamplingOptions

if TYPE_CHECKING:
    import torch

PROMPTS = ("weightsync says: ", "an engine writes: ")


def reward(text: str, num_tokens: int) -> float:
    """The share of a completion's `num_tokens` byte tokens that are lowercase ASCII letters,
    given its decoded `text` (special tokens skipped): each letter is one token, and no other
    token decodes to one."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens}: a completion has at least one token")
    return min(1.0, sum("a" <= ch <= "z" for ch in text) / num_tokens)


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """Rewards minus their group's mean, over the group's standard deviation (+1e-4): groups
    are consecutive runs of `group_size`. A group whose rewards are all equal gets zeros."""
    if group_size < 2 or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards in groups of {group_size}: need groups of at "
            f"least 2 that divide the rewards"
        )
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        out += [(r - mean) / (std + 1e-4) for r in group]
    return out


def mismatch(sampler: list[list[float]], learner: list[list[float]]) -> dict[str, float]:
    """Mean |sampler - learner| and the k3 estimate of KL(sampler || learner) over all sampled
    tokens (log-probabilities of the same tokens; k3 = exp(l - s) - 1 - (l - s) >= 0)."""
    deltas = [
        lv - sv
        for s_row, l_row in zip(sampler, learner, strict=True)
        for sv, lv in zip(s_row, l_row, strict=True)
    ]
    if not deltas:
        raise ValueError("no sampled tokens to compare")
    return {
        "mean_abs": sum(abs(d) for d in deltas) / len(deltas),
        "kl": sum(math.expm1(d) - d for d in deltas) / len(deltas),
        "max_abs": max(abs(d) for d in deltas),
    }


# ---- the trainer ranks' side --------------------------------------------------------------------
def token_logprobs(
    model: torch.nn.Module, rollouts: list[dict[str, Any]], *, temperature: float
) -> list[torch.Tensor]:
    """Log-probabilities (float32, with grad) of each rollout's "tokens" after its "prompt",
    under softmax(logits / temperature); one right-padded forward pass."""
    import torch

    device = next(model.parameters()).device
    rows = [r["prompt"] + r["tokens"] for r in rollouts]
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=device)
        mask[i, : len(row)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = []
    for i, r in enumerate(rollouts):
        start = len(r["prompt"]) - 1
        out.append(picked[i, start : start + len(r["tokens"])])
    return out


def policy_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: list[dict[str, Any]],
    *,
    temperature: float = 1.0,
    clip_eps: float = 0.2,
    num_updates: int = 2,
    max_behavior_weight: float = 2.0,
) -> dict[str, Any]:
    """`num_updates` clipped policy-gradient updates on `rollouts` ({"prompt", "tokens",
    "advantage"}), every trainer rank at once with the same list; each rank computes rank::world
    of them and FSDP2 averages the gradients. The loss is per token, -min(ratio * A,
    clip(ratio, 1 +- clip_eps) * A), ratio = exp(logp - logp of the learner's weights before
    the first update); averaged over all tokens of all rollouts. A rollout with "behavior" (the
    log-probs of the weights that sampled it, when those may be older than the learner's:
    `GrpoConfig.off_policy`) has each token's loss weighed by exp(learner's - behavior),
    truncated at `max_behavior_weight` (the decoupled clipped objective: the clip keeps each
    update near the learner's weights, the weight corrects for the sampler's). Returns
    {"learner_logprobs": per rollout, in order, of the learner's weights before the first
    update; "loss": of the first update} on every rank."""
    import torch
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(rollouts) < world:
        raise ValueError(
            f"{len(rollouts)} rollouts for {world} trainer ranks: every rank needs one"
        )
    mine = rollouts[rank::world]
    num_tokens = sum(len(r["tokens"]) for r in rollouts)
    advantages = [torch.tensor(r["advantage"]) for r in mine]
    # Off-policy rollouts carry the log-probs of the weights that sampled them ("behavior",
    # the engine's), which may be a version behind the learner's.
    behavior = [
        torch.tensor(r["behavior"], dtype=torch.float32) if "behavior" in r else None for r in mine
    ]
    model.train()
    first: list[torch.Tensor] = []
    losses = []
    for update in range(num_updates):
        logprobs = token_logprobs(model, mine, temperature=temperature)
        if update == 0:
            first = [lp.detach() for lp in logprobs]
        loss = torch.zeros(())
        for lp, own, behaves, adv in zip(logprobs, first, behavior, advantages, strict=True):
            ratio = torch.exp(lp - own)
            clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
            token_loss = torch.minimum(ratio * adv, clipped * adv)
            if behaves is not None:
                weight = torch.exp(own - behaves.to(lp.device))
                token_loss = token_loss * torch.clamp(weight, max=max_behavior_weight)
            loss = loss - token_loss.sum()
        # FSDP2 averages gradients over ranks: scale so the sum is the mean over all tokens.
        loss = loss * world / num_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / world)
    model.eval()
    gathered: list[Any] = [None] * world
    mine_lp = [lp.tolist() for lp in first]
    if world > 1:
        dist.all_gather_object(gathered, mine_lp)
    else:
        gathered = [mine_lp]
    learner = [gathered[i % world][i // world] for i in range(len(rollouts))]
    return {"learner_logprobs": learner, "loss": losses[0]}


# ---- the driver's side ---------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class GrpoConfig:
    """A GRPO run's settings (the demo's defaults: a visible rise in about 20 steps on 2 cores)."""

    steps: int = 24
    """Steps, each: rollouts from every engine, a policy step, a verified sync."""
    group_size: int = 8
    """Samples per prompt per engine; advantages are normalised within each such group."""
    max_new_tokens: int = 12
    """Tokens per completion: exactly this many (end-of-sequence is ignored), so every
    completion is rewarded over the same length."""
    temperature: float = 1.0
    """Sampling temperature, and the learner's. At 1 the engines' log-probabilities and the
    learner's are of the same distribution (vLLM's are of raw logits at any temperature)."""
    top_p: float = 1.0
    clip_eps: float = 0.2
    """PPO clip range of the ratio."""
    num_updates: int = 2
    """Policy-gradient updates per step on the same rollouts (the second is where clipping acts)."""
    seed: int = 0
    """Sampling seed of step s: seed + 1000 * s (per-sample seeds follow SamplingOptions)."""
    off_policy: bool = False
    """Keep sampling while the engines sync: step s samples while the weights of step s - 1
    are synced (staged: the engines serve the old weights until they switch), so a rollout
    comes from version step-(s-1) or step-(s-2) (lag 0 or 1, reported per rollout), and each
    rollout's loss is weighed by the learner's over the sampler's probabilities (`policy_step`). The
    trainer must sync with `SyncOptions(staged=True)`."""
    prompts: tuple[str, ...] = field(default=PROMPTS)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: need at least 1")
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: GRPO needs at least 2 per group")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps={self.clip_eps}: must be in (0, 1)")
        if self.num_updates < 1:
            raise ValueError(f"num_updates={self.num_updates}: must be at least 1")
        if not self.prompts:
            raise ValueError("prompts: give at least one")
        self.sampling(0)  # bad sampling options fail here, before any engine is asked

    def sampling(self, step: int) -> SamplingOptions:
        return SamplingOptions(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            n=self.group_size,
            seed=self.seed + 1000 * step,
            ignore_eos=True,
        )


def version_index(version: str) -> int:
    """N of a demo version "step-N"."""
    head, _, number = version.partition("-")
    if head != "step" or not number.isdigit():
        raise ValueError(f"weight version {version!r}: expected 'step-N'")
    return int(number)


class GrpoLoop:
    """Drives GRPO steps over a `TrainerGroup` (whose ranks have `grpo_step`, `sync`) and engine
    actors (`generate`), from the driver. `start()` syncs once (version "step-0"), so the first
    rollouts already come from a known version; `step(s)` returns the step's plain-data record;
    `finish()` syncs what the last step learned when `GrpoConfig.off_policy` left it unsynced.

    On-policy (the default), step s: every engine samples with version step-(s-1), the trainer
    learns, one verified sync brings every engine to step-s. Off-policy, step s: the sync of
    step-(s-1) (staged, verified) runs while the engines sample, one call per prompt, so an
    engine's calls before its switch serve step-(s-2) and those after it step-(s-1); then the
    trainer learns from them, each weighed by the learner's over its sampler's probabilities."""

    def __init__(
        self,
        trainer: Any,
        engines: dict[str, Any],
        config: GrpoConfig,
        *,
        encode: Any,
        decode: Any,
        timeout_s: float = 600.0,
    ) -> None:
        self.trainer = trainer
        self.engines = engines
        self.config = config
        self.decode = decode
        self.prompt_ids = [encode(p) for p in config.prompts]
        self.timeout_s = timeout_s
        self.version = ""
        """The version every engine serves (last synced)."""
        self.learned = ""
        """Off-policy: the version the trainer holds and has not synced yet ("" when none)."""

    def start(self) -> dict[str, Any]:
        report = self._sync("step-0")
        return {"version": self.version, "verified": self._verified(report)}

    def finish(self) -> dict[str, Any] | None:
        """Off-policy: sync the last step's weights (verified) so every engine ends on them;
        None when nothing is left to sync."""
        if not self.learned:
            return None
        report = self._sync(self.learned)
        self.learned = ""
        return {"version": self.version, "verified": self._verified(report)}

    def _sync(self, version: str) -> dict[str, Any]:
        report = self.trainer.call("sync", version, verify=True)
        self.version = version
        return report

    def _verified(self, report: dict[str, Any]) -> dict[str, bool]:
        return {name: bool(report["verify"][name]["verified"]) for name in self.engines}

    def _sample(self, options: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Every engine's rollouts, a row per sample grouped by prompt, each with the version
        that served it ("versions"). Off-policy: one call per prompt, so that a sync's calls
        to the engine come between them."""
        import ray

        calls = [[p] for p in self.prompt_ids] if self.config.off_policy else [self.prompt_ids]
        refs = {
            name: [h.generate.remote(c, **options) for c in calls]
            for name, h in self.engines.items()
        }
        outs = {}
        for name, engine_refs in refs.items():
            answers = [ray.get(ref, timeout=self.timeout_s) for ref in engine_refs]
            outs[name] = {
                "tokens": [t for a in answers for t in a["tokens"]],
                "logprobs": [lp for a in answers for lp in a["logprobs"]],
                "versions": [str(a["weight_version"]) for a in answers for _ in a["tokens"]],
            }
        return outs

    def step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        options = asdict(cfg.sampling(step))
        n = cfg.group_size
        start = time.perf_counter()
        pending = None
        if cfg.off_policy and self.learned:
            pending = (self.learned, self.trainer.submit("sync", self.learned, verify=True))
        outs = self._sample(options)
        rollout_s = time.perf_counter() - start
        overlapped = None
        if pending is not None:
            version, call = pending
            overlapped = call.result()
            self.version, self.learned = version, ""
        # Off-policy: how long the driver waited for the sync once the rollouts were in.
        sync_wait_s = time.perf_counter() - start - rollout_s
        # Lag of a rollout: how many versions its weights are behind the learner's now.
        learner = step - 1
        allowed = [f"step-{learner}"] + (
            [f"step-{learner - 1}"] if cfg.off_policy and learner >= 1 else []
        )
        rollouts: list[dict[str, Any]] = []
        per_engine: dict[str, dict[str, Any]] = {}
        for name, out in outs.items():
            rewards = [reward(self.decode(t), len(t)) for t in out["tokens"]]
            advantages = group_advantages(rewards, n)
            first = len(rollouts)
            for i, (t, a) in enumerate(zip(out["tokens"], advantages, strict=True)):
                row = {"prompt": self.prompt_ids[i // n], "tokens": t, "advantage": a}
                if cfg.off_policy:
                    row["behavior"] = out["logprobs"][i]
                rollouts.append(row)
            versions = sorted(set(out["versions"]))
            on_version = set(versions) <= set(allowed)
            per_engine[name] = {
                "reward": sum(rewards) / len(rewards),
                "rows": (first, len(rollouts)),
                "versions": versions,
                "lags": [learner - version_index(v) for v in out["versions"]]
                if on_version
                else None,
                "expected_version": allowed[0],
                **({"allowed_versions": allowed} if cfg.off_policy else {}),
                "on_version": on_version,
                "sample": self.decode(out["tokens"][0]),
                "num_rollouts": len(out["tokens"]),
                "num_tokens": sum(len(t) for t in out["tokens"]),
            }
        start = time.perf_counter()
        learned = self.trainer.call(
            "grpo_step",
            rollouts,
            temperature=cfg.temperature,
            clip_eps=cfg.clip_eps,
            num_updates=cfg.num_updates,
        )
        train_s = time.perf_counter() - start
        for name, rec in per_engine.items():
            lo, hi = rec.pop("rows")
            sampler, learner_lps = outs[name]["logprobs"], learned["learner_logprobs"][lo:hi]
            if not cfg.off_policy:
                rec.pop("lags")
                rec.update(mismatch(sampler, learner_lps))
                continue
            # The mismatch is of the rollouts that the learner's weights sampled (lag 0); those
            # one version behind ("stale_") differ by a whole update, which shows their tag true.
            for prefix, lag in (("", 0), ("stale_", 1)):
                rows = [i for i, g in enumerate(rec["lags"] or []) if g == lag]
                gap: dict[str, Any] = dict.fromkeys(("mean_abs", "kl", "max_abs"))
                if rows:
                    gap = mismatch([sampler[i] for i in rows], [learner_lps[i] for i in rows])
                rec.update({prefix + k: v for k, v in gap.items()})
        if cfg.off_policy:
            self.learned = f"step-{step}"
            report = overlapped
            sync_s = float(report["sync_s"]) if report is not None else 0.0
        else:
            start = time.perf_counter()
            report = self._sync(f"step-{step}")
            sync_s = time.perf_counter() - start
        for name, rec in per_engine.items():
            if report is None:
                rec.update(verified=None, sync_s=None)
                continue
            engine = report["engines"][name]
            rec["verified"] = bool(report["verify"][name]["verified"])
            rec["sync_s"] = float(engine.get("session_s", report["sync_s"]))
            if cfg.off_policy:
                rec["pause_s"] = engine.get("pause_s")
        out = {
            "step": step,
            "loss": learned["loss"],
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "version": self.version,
            "engines": per_engine,
        }
        if cfg.off_policy:
            out["synced"] = None if report is None else self.version
            out["sync_wait_s"] = sync_wait_s
        return out


LEARNING_MIN_STEPS = 12
"""Runs shorter than this are not judged on learning: in docs/grpo.md's captured run (OPT tiny,
both engines) the mean reward went from 0.057 / 0.089 (SGLang / vLLM) at step 1 to 0.187 / 0.187
at step 6, less than `Verdict.min_gain` above it, and to 0.641 / 0.667 at step 12; the e2e test's
12-step run passes the rule."""


@dataclass(kw_only=True, slots=True)
class Verdict:
    """What `weightsync demo` exits 0 on: every sync verified, every rollout from the version
    synced just before it (off-policy: or the one before that, whose rollouts must then differ
    from the learner's weights by at least `max_mean_abs`), the mean |log-prob delta| of every
    step's rollouts of the learner's weights below `max_mean_abs`, and,
    for runs of at least `learning_min_steps`, the mean reward of the last `window` steps (at
    most a quarter of them) at least `min_gain` above the first ones' (per engine). A shorter
    run cannot show learning, so it is judged on the rest (`learning_judged` False)."""

    window: int = 5
    min_gain: float = 0.15
    max_mean_abs: float = 2e-3
    learning_min_steps: int = LEARNING_MIN_STEPS
    failures: list[str] = field(default_factory=list)
    learning_judged: bool = False

    def judge(
        self,
        steps: list[dict[str, Any]],
        *,
        start_verified: dict[str, bool],
        end_verified: dict[str, bool] | None = None,
    ) -> Verdict:
        """`end_verified`: the sync after the last step, where there is one (off-policy)."""
        out = replace(self, failures=[], learning_judged=len(steps) >= self.learning_min_steps)
        out.failures += [
            f"{n}: the first sync (step-0) did not verify"
            for n, ok in start_verified.items()
            if not ok
        ]
        out.failures += [
            f"{n}: the last sync (after step {len(steps)}) did not verify"
            for n, ok in (end_verified or {}).items()
            if not ok
        ]
        for s in steps:
            for name, e in s["engines"].items():
                # None: no sync ran in this step (the first step of an off-policy run).
                if e["verified"] is not None and not e["verified"]:
                    out.failures.append(f"step {s['step']}: {name}'s sync did not verify")
                if not e["on_version"]:
                    allowed = e.get("allowed_versions", [e["expected_version"]])
                    out.failures.append(
                        f"step {s['step']}: {name} sampled with versions "
                        f"{e['versions']}, expected {' or '.join(map(repr, allowed))}"
                    )
                # None: no rollout of this step came from the learner's weights (off-policy).
                if e["mean_abs"] is not None and not e["mean_abs"] < self.max_mean_abs:
                    out.failures.append(
                        f"step {s['step']}: {name}'s mean |log-prob delta| "
                        f"{e['mean_abs']:.2e} >= bound {self.max_mean_abs:.0e}"
                    )
                stale = e.get("stale_mean_abs")
                if stale is not None and not stale >= self.max_mean_abs:
                    out.failures.append(
                        f"step {s['step']}: {name}'s rollouts tagged one version behind match "
                        f"the learner's weights (mean |log-prob delta| {stale:.2e} < bound "
                        f"{self.max_mean_abs:.0e}): their version tag is wrong"
                    )
        if not out.learning_judged:
            return out
        window = max(1, min(self.window, len(steps) // 4))
        for name in steps[0]["engines"]:
            first = sum(s["engines"][name]["reward"] for s in steps[:window]) / window
            last = sum(s["engines"][name]["reward"] for s in steps[-window:]) / window
            if not last >= first + self.min_gain:
                out.failures.append(
                    f"{name}: mean reward of the last {window} steps {last:.3f} "
                    f"is not {self.min_gain} above the first {window}' {first:.3f}"
                )
        return out

    @property
    def ok(self) -> bool:
        return not self.failures
