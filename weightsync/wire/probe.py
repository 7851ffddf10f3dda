"""The log-prob probe: an end-to-end check of an update that does not trust the engine's loader.

Fingerprints (weightsync/wire/fingerprint.py) compare each engine parameter with the trainer's
bytes placed where the engine's own loader puts them; a loader wrong from the first sync (q and k
swapped inside a fused parameter, a transposed tensor, a tensor it drops) puts them wrong
consistently, and the fingerprints agree. The probe asks the model instead: the trainer scores a
fixed token sequence with its own forward (`expected`: the log-probability of each token given
the ones before it), the engine scores the same tokens with its forward on the staged weights,
every tensor-parallel worker included, and the mean absolute gap must stay within `bound`
(nats), and each token's gap within `max_bound`, or the engine refuses to commit the update (`ProbeFailed`; the sender aborts it, and with
keep_previous the engine puts its previous weights back).

Plain data only: `ProbeRequest` travels with `end`, `ProbeReport` comes back in its answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.wire.errors import ProbeFailed


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRequest:
    """What the engine scores and what it must come close to."""

    tokens: list[list[int]]
    """Prompts of token ids (each at least 2 long)."""
    expected: list[list[float]]
    """Per prompt, the trainer's log-probability of tokens[i][j] given tokens[i][:j], j >= 1."""
    bound: float
    """The largest mean absolute gap (nats) an update may show."""
    max_bound: float | None = None
    """The largest gap (nats) any one scored token may show; None: no such bound."""

    def __post_init__(self) -> None:
        if not self.tokens or any(len(t) < 2 for t in self.tokens):
            raise ValueError(
                f"a probe needs prompts of at least 2 tokens, got {self.tokens!r:.200}"
            )
        if [len(e) for e in self.expected] != [len(t) - 1 for t in self.tokens]:
            raise ValueError(
                f"probe: expected log-probs of lengths {[len(e) for e in self.expected]}, "
                f"need one per token after the first: {[len(t) - 1 for t in self.tokens]}"
            )
        if not (self.bound > 0 and math.isfinite(self.bound)):
            raise ValueError(f"probe bound={self.bound!r}: must be a positive number of nats")
        if self.max_bound is not None and not (
            self.max_bound > 0 and math.isfinite(self.max_bound)
        ):
            raise ValueError(
                f"probe max_bound={self.max_bound!r}: must be a positive number of nats or None"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "expected": self.expected,
            "bound": self.bound,
            "max_bound": self.max_bound,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeRequest:
        return cls(
            tokens=[[int(t) for t in prompt] for prompt in d["tokens"]],
            expected=[[float(x) for x in row] for row in d["expected"]],
            bound=float(d["bound"]),
            max_bound=None if d.get("max_bound") is None else float(d["max_bound"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeReport:
    """How close the engine's scores came to the trainer's."""

    mean_gap: float
    """Mean absolute log-prob gap over every scored token (nats)."""
    max_gap: float
    """The largest one."""
    worst: tuple[int, int]
    """(prompt, position) of the largest gap."""
    num_tokens: int
    bound: float
    probe_s: float = 0.0
    """Seconds the engine's forward took."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean_gap": self.mean_gap,
            "max_gap": self.max_gap,
            "worst": list(self.worst),
            "num_tokens": self.num_tokens,
            "bound": self.bound,
            "probe_s": self.probe_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeReport:
        worst = d.get("worst") or (0, 0)
        return cls(
            mean_gap=float(d["mean_gap"]),
            max_gap=float(d["max_gap"]),
            worst=(int(worst[0]), int(worst[1])),
            num_tokens=int(d["num_tokens"]),
            bound=float(d["bound"]),
            probe_s=float(d.get("probe_s", 0.0)),
        )


def check_probe(
    request: ProbeRequest,
    got: Sequence[Sequence[float]],
    *,
    engine: str,
    version: str,
    probe_s: float = 0.0,
) -> ProbeReport:
    """Compare the engine's scores `got` (shaped like `request.expected`) with the trainer's;
    raise `ProbeFailed` when the mean gap exceeds `bound`, one token's gap exceeds `max_bound`,
    or a score is not finite."""
    if [len(row) for row in got] != [len(row) for row in request.expected]:
        raise ProbeFailed(
            f"{engine}: the probe of update {version!r} scored "
            f"{[len(row) for row in got]} tokens per prompt, expected "
            f"{[len(row) for row in request.expected]}; the update is not committed"
        )
    gaps = [
        (abs(float(g) - float(e)) if math.isfinite(float(g)) else math.inf, i, j)
        for i, (grow, erow) in enumerate(zip(got, request.expected))
        for j, (g, e) in enumerate(zip(grow, erow))
    ]
    worst_gap, wi, wj = max(gaps)
    mean = sum(g for g, _, _ in gaps) / len(gaps)
    report = ProbeReport(
        mean_gap=mean,
        max_gap=worst_gap,
        worst=(wi, wj + 1),
        num_tokens=len(gaps),
        bound=request.bound,
        probe_s=probe_s,
    )
    if not mean <= request.bound:
        raise ProbeFailed(
            f"{engine}: update {version!r} failed the log-prob probe: the engine's forward on "
            f"the staged weights scores {len(gaps)} probe tokens {mean:.4g} nats away from the "
            f"trainer's on average (bound {request.bound:g}; worst {worst_gap:.4g} at prompt "
            f"{wi}, token {wj + 1}); its loader put some tensor where the model does not read "
            f"it (swapped, transposed or dropped). The update is not committed."
        )
    if request.max_bound is not None and not worst_gap <= request.max_bound:
        raise ProbeFailed(
            f"{engine}: update {version!r} failed the log-prob probe: the engine's forward on "
            f"the staged weights scores token {wj + 1} of prompt {wi} {worst_gap:.4g} nats away "
            f"from the trainer's (max_bound {request.max_bound:g}; mean over {len(gaps)} "
            f"tokens {mean:.4g}, within its bound {request.bound:g}); some tensor the model "
            f"reads for it (an embedding row, an expert) is not the trainer's. The update is "
            f"not committed."
        )
    return report


def score_causal_lm(model: Any, tokens: list[list[int]]) -> list[list[float]]:
    """`expected` for `tokens` from a causal LM called as `model(input_ids=ids)` (its output or
    its `.logits`: [batch, length, vocab]): log-softmax in float32, each token's log-probability
    given the ones before it. One prompt at a time, in eval mode (no
    dropout), without gradients; every process holding a shard of `model` must call it."""
    import torch

    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out: list[list[float]] = []
        with torch.no_grad():
            for prompt in tokens:
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                result = model(input_ids=ids)
                logits = getattr(result, "logits", result)
                if hasattr(logits, "full_tensor"):  # a DTensor (a tensor-parallel head)
                    logits = logits.full_tensor()
                logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
                picked = logp.gather(1, ids[0, 1:, None]).squeeze(1)
                out.append([float(x) for x in picked.cpu()])
        return out
    finally:
        model.train(was_training)
