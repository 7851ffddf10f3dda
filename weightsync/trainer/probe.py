"""`Probe`: how a `TrainerSync` checks engines end to end, independent of their loaders.

On the first sync into each engine after `connect` (and every `every`-th sync after that), every
trainer rank runs the model's forward on fixed token ids (a collective, as FSDP2's forward
gathers its shards) and continues each greedily for `decode` steps, and each probed engine
scores the same ids with its own forward, and decodes as many steps greedily, on the staged
weights before it commits them (weightsync/wire/probe.py). A mean absolute log-prob gap
above `bound`, or one token's gap above `max_bound`, fails the sync with `ProbeFailed`; the update is aborted (rolled back with
keep_previous).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.wire.probe import ProbeRequest, greedy_causal_lm, score_causal_lm

DEFAULT_DECODE = 4
"""`Probe.decode` when not given (and no custom score)."""

Scorer = Callable[[list[list[int]]], list[list[float]]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """`SyncOptions.probe`. Checked when made: a bad value raises ValueError."""

    tokens: Sequence[Sequence[int]] | None = None
    """The prompts to score (token ids, each at least 2 long). None: `num_prompts` prompts of
    `length` ids drawn with `seed` from the model's vocabulary (`model.config.vocab_size`)."""
    num_prompts: int = 2
    length: int = 32
    seed: int = 0
    every: int = 0
    """0: probe each engine on its first sync after `connect` only; n > 0: also every n-th
    sync (counted by this `TrainerSync`)."""
    bound: float = 0.1
    """The largest mean absolute gap (nats) between the engine's and the trainer's log-probs.
    Two forwards in float32 agree to ~1e-5 on the test models; bfloat16 engines differ from a
    float32 trainer by more, growing with depth: set it from a sync known to be right."""
    max_bound: float | None = 1.0
    """The largest gap (nats) any one scored token may show: a fault that reaches few tokens
    (one embedding row, one expert) moves the mean little. None: no such bound. Set it, as
    `bound`, from a sync known to be right (bfloat16 engines differ from a float32 trainer
    token by token by more than on average)."""
    score: Scorer | None = None
    """The trainer's scores for `tokens` (per prompt, each token's log-prob after the first),
    called on every rank at once. None: the model called as `model(input_ids=ids)`, its
    logits in float32 (`wire.probe.score_causal_lm`)."""
    decode: int | None = None
    """Greedy decode steps scored after each prompt (wire/probe.py: the engine's decode path,
    which a prefill does not take: KV cache, tensors derived for decode). The trainer continues
    each prompt with its model's forward (`model(input_ids=ids)`), one forward per step. None:
    4, or 0 with a custom `score`; 0: none."""

    @property
    def decode_steps(self) -> int:
        if self.decode is None:
            return 0 if self.score is not None else DEFAULT_DECODE
        return self.decode

    def __post_init__(self) -> None:
        for name in ("num_prompts", "length", "every", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Probe.{name}={value!r}: must be an int >= 0")
        if self.length < 2 or self.num_prompts < 1:
            raise ValueError(
                f"Probe(num_prompts={self.num_prompts}, length={self.length}): a probe needs "
                f"at least one prompt of at least 2 tokens"
            )
        if not (
            isinstance(self.bound, int | float) and self.bound > 0 and math.isfinite(self.bound)
        ):
            raise ValueError(f"Probe.bound={self.bound!r}: must be a positive number of nats")
        if self.max_bound is not None and not (
            isinstance(self.max_bound, int | float)
            and self.max_bound > 0
            and math.isfinite(self.max_bound)
        ):
            raise ValueError(
                f"Probe.max_bound={self.max_bound!r}: must be a positive number of nats, or None"
            )
        if self.decode is not None and (
            not isinstance(self.decode, int) or isinstance(self.decode, bool) or self.decode < 0
        ):
            raise ValueError(f"Probe.decode={self.decode!r}: must be an int >= 0, or None")
        if self.score is not None and self.decode:
            raise ValueError(
                f"Probe(score=..., decode={self.decode}): decode steps continue each prompt "
                f"with the model's own forward, which a custom score replaces; give decode=0"
            )
        if self.tokens is not None and (not self.tokens or any(len(p) < 2 for p in self.tokens)):
            raise ValueError(
                f"Probe.tokens={self.tokens!r:.200}: give prompts of at least 2 token ids each"
            )

    @classmethod
    def of(cls, value: Probe | dict[str, Any] | bool | None) -> Probe | None:
        """A `Probe` from what a caller passes across an environment boundary: a `Probe`, its
        fields as a dict, True (the defaults) or None/False (no probe)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, cls):
            return value
        raise ValueError(f"probe={value!r}: expected a Probe, a dict of its fields, or True")

    def prompts(self, model: Any) -> list[list[int]]:
        if self.tokens is not None:
            return [[int(t) for t in prompt] for prompt in self.tokens]
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            raise ValueError(
                f"Probe(tokens=None) draws token ids from model.config.vocab_size, which this "
                f"{type(model).__name__} lacks: give Probe(tokens=[[...], ...])"
            )
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab) for _ in range(self.length)] for _ in range(self.num_prompts)]


class ProbeScorer:
    """One `TrainerSync`'s probe: its prompts and when each engine is due."""

    def __init__(self, probe: Probe, model: Any) -> None:
        self.probe = probe
        self.model = model
        self.tokens = probe.prompts(model)
        self.probed: set[str] = set()  # engines probed since they were connected

    def due(self, names: list[str], sync_number: int) -> list[str]:
        """The engines of this sync (`sync_number`: 1 for the first) that score the probe."""
        every = self.probe.every
        return [
            n for n in names if n not in self.probed or (every > 0 and sync_number % every == 0)
        ]

    def request(self) -> dict[str, Any]:
        """The trainer's scores (every rank at once) as the engines' `ProbeRequest`."""
        score = self.probe.score or (lambda tokens: score_causal_lm(self.model, tokens))
        steps = self.probe.decode_steps
        with ExpertsReached(self.model) as experts:
            expected = score(self.tokens)
            decoded = greedy_causal_lm(self.model, self.tokens, steps) if steps else []
        return ProbeRequest(
            tokens=self.tokens,
            expected=expected,
            bound=self.probe.bound,
            max_bound=self.probe.max_bound,
            decode_tokens=[d.tokens for d in decoded],
            decode_expected=[d.logprobs for d in decoded],
            experts=experts.summary(),
        ).to_dict()


class ExpertsReached:
    """Which routed experts the probe's tokens reach in the trainer's forward, per MoE layer:
    a fault in an expert no probe token reaches cannot move the probe's scores. Hooks each
    router (a module named `gate` or `router`, or whose class name ends in Router): its
    output's integer tensor is the chosen experts (transformers' routers return (logits,
    weights, indices)); a float tensor of `num_experts` columns is router logits, whose top
    `num_experts_per_tok` are. Models without such routers report nothing."""

    def __init__(self, model: Any) -> None:
        config = getattr(model, "config", None)
        self.num_experts = next(
            (
                n
                for n in (
                    getattr(config, key, None)
                    for key in ("num_experts", "n_routed_experts", "num_local_experts")
                )
                if isinstance(n, int) and n > 1
            ),
            0,
        )
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.model = model
        self.reached: dict[str, set[int]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> ExpertsReached:
        if self.num_experts:
            for name, module in self.model.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("gate", "router") or type(module).__name__.endswith("Router"):
                    self.handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        import torch

        def record(_module: Any, _inputs: Any, output: Any) -> None:
            outputs = output if isinstance(output, tuple | list) else (output,)
            tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
            chosen = next((t for t in tensors if not t.is_floating_point()), None)
            if chosen is None:
                logits = next((t for t in tensors if t.shape[-1] == self.num_experts), None)
                if logits is None or not self.top_k:
                    return
                chosen = logits.float().topk(self.top_k, dim=-1).indices
            if hasattr(chosen, "full_tensor"):
                chosen = chosen.full_tensor()
            self.reached.setdefault(name, set()).update(int(e) for e in chosen.flatten().tolist())

        return record

    def summary(self) -> dict[str, Any] | None:
        """{"experts": routed experts per layer, "reached": [distinct experts reached, per MoE
        layer in the model's order]}, or None (no routers found)."""
        if not self.reached:
            return None
        return {
            "experts": self.num_experts,
            "reached": [len(self.reached[name]) for name in self.reached],
        }
