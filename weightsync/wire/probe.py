"""The log-prob probe: an end-to-end check of an update that does not trust the engine's loader.

Fingerprints (weightsync/wire/fingerprint.py) compare each engine parameter with the trainer's
bytes placed where the engine's own loader puts them; a loader wrong from the first sync (q and k
swapped inside a fused parameter, a transposed tensor, a tensor it drops) puts them wrong
consistently, and the fingerprints agree. The probe asks the model instead: the trainer scores a
fixed token sequence with its own forward (`expected`: the log-probability of each token given
the ones before it), the engine scores the same tokens with its forward on the staged weights,
every tensor-parallel worker included, and the mean absolute gap must stay within `bound`
(nats), and each token's gap within `max_bound`, or the engine refuses to commit the update
(`ProbeFailed`; the sender aborts it, and with keep_previous the engine puts its previous
weights back).

Decode positions: a prefill reads every weight once per token, but an engine decodes through
other kernels and tensors (KV cache, incremental attention, tensors derived after loading such
as MLA's up-projections). The trainer also continues each prompt greedily (`decode_tokens`,
with their log-probs `decode_expected`); the engine decodes the same number of tokens greedily
on the staged weights, and each step counts as one more scored token: its log-prob of the
trainer's token at that step (its own choice, or found among its `DECODE_TOP` most likely when
two tokens nearly tie). Steps after the first where the two choose differently are not scored:
their contexts differ. A trainer token outside the engine's most likely fails the probe.

Plain data only: `ProbeRequest` travels with `end`, `ProbeReport` comes back in its answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.wire.errors import ProbeFailed

DECODE_TOP = 5
"""How many of its most likely tokens the engine returns at each decode step of the probe."""


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
    decode_tokens: list[list[int]] = field(default_factory=list)
    """Per prompt, the trainer's greedy continuation (empty: no decode positions)."""
    decode_expected: list[list[float]] = field(default_factory=list)
    """The trainer's log-probability of each token of `decode_tokens`."""
    experts: dict[str, Any] | None = None
    """An MoE model: the routed experts the probe's tokens reached in the trainer's forward
    ({"experts": per layer, "reached": [distinct experts reached, per MoE layer]}), which the
    engine's report carries back."""

    @property
    def decode_steps(self) -> int:
        return len(self.decode_tokens[0]) if self.decode_tokens else 0

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
        if self.decode_tokens and (
            len(self.decode_tokens) != len(self.tokens)
            or len({len(t) for t in self.decode_tokens}) != 1
            or [len(e) for e in self.decode_expected] != [len(t) for t in self.decode_tokens]
        ):
            raise ValueError(
                f"probe: decode_tokens of lengths {[len(t) for t in self.decode_tokens]} and "
                f"decode_expected of {[len(e) for e in self.decode_expected]}: need one equal "
                f"length per prompt ({len(self.tokens)} prompts), one log-prob per token"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "expected": self.expected,
            "bound": self.bound,
            "max_bound": self.max_bound,
            "decode_tokens": self.decode_tokens,
            "decode_expected": self.decode_expected,
            "experts": self.experts,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeRequest:
        return cls(
            tokens=[[int(t) for t in prompt] for prompt in d["tokens"]],
            expected=[[float(x) for x in row] for row in d["expected"]],
            bound=float(d["bound"]),
            max_bound=None if d.get("max_bound") is None else float(d["max_bound"]),
            decode_tokens=[[int(t) for t in row] for row in d.get("decode_tokens") or []],
            decode_expected=[[float(x) for x in row] for row in d.get("decode_expected") or []],
            experts=d.get("experts"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Decoded:
    """One prompt's greedy decode by the engine: its tokens, their log-probs, and at each step
    its `DECODE_TOP` most likely (token id, log-prob)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeReport:
    """How close the engine's scores came to the trainer's."""

    mean_gap: float
    """Mean absolute log-prob gap over every scored token (nats)."""
    max_gap: float
    """The largest one."""
    worst: tuple[int, int]
    """(prompt, position) of the largest gap; a decode step s as position -1 - s."""
    num_tokens: int
    bound: float
    probe_s: float = 0.0
    """Seconds the engine's forward took."""
    decode_steps: int = 0
    """Decode steps scored (among `num_tokens`), over every prompt."""
    decode_max_gap: float = 0.0
    """The largest gap among them."""
    experts: dict[str, Any] | None = None
    """`ProbeRequest.experts`: what the probe's tokens reached."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean_gap": self.mean_gap,
            "max_gap": self.max_gap,
            "worst": list(self.worst),
            "num_tokens": self.num_tokens,
            "bound": self.bound,
            "probe_s": self.probe_s,
            "decode_steps": self.decode_steps,
            "decode_max_gap": self.decode_max_gap,
            "experts": self.experts,
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
            decode_steps=int(d.get("decode_steps", 0)),
            decode_max_gap=float(d.get("decode_max_gap", 0.0)),
            experts=d.get("experts"),
        )


def check_probe(
    request: ProbeRequest,
    got: Sequence[Sequence[float]],
    *,
    engine: str,
    version: str,
    probe_s: float = 0.0,
    decoded: Sequence[Decoded] = (),
) -> ProbeReport:
    """Compare the engine's scores `got` (shaped like `request.expected`) and its greedy
    decode `decoded` (one per prompt, when the request has decode positions) with the
    trainer's; raise `ProbeFailed` when the mean gap exceeds `bound`, one token's gap exceeds
    `max_bound`, or a score is not finite."""
    if [len(row) for row in got] != [len(row) for row in request.expected]:
        raise ProbeFailed(
            f"{engine}: the probe of update {version!r} scored "
            f"{[len(row) for row in got]} tokens per prompt, expected "
            f"{[len(row) for row in request.expected]}; the update is not committed"
        )
    if request.decode_steps and len(decoded) != len(request.decode_tokens):
        raise ProbeFailed(
            f"{engine}: the probe of update {version!r} decoded {len(decoded)} prompts, "
            f"expected {len(request.decode_tokens)}; the update is not committed"
        )
    gaps = [
        (abs(float(g) - float(e)) if math.isfinite(float(g)) else math.inf, i, j + 1)
        for i, (grow, erow) in enumerate(zip(got, request.expected))
        for j, (g, e) in enumerate(zip(grow, erow))
    ]
    steps = _decode_gaps(request, decoded) if request.decode_steps else []
    scored = gaps + [(gap, i, -1 - j) for gap, i, j in steps]  # a decode step: position < 0
    worst_gap, wi, wj = max(scored)
    # A trainer's token outside the engine's most likely (an infinite gap) fails on its own,
    # after the mean over the rest: a loader fault that the prefill shows is named as one.
    finite = [g for g, _, j in scored if j > 0 or math.isfinite(g)]
    mean = sum(finite) / len(finite)
    report = ProbeReport(
        mean_gap=mean,
        max_gap=worst_gap,
        worst=(wi, wj),
        num_tokens=len(scored),
        bound=request.bound,
        probe_s=probe_s,
        decode_steps=len(steps),
        decode_max_gap=max((g for g, _, _ in steps), default=0.0),
        experts=request.experts,
    )
    where = f"decode step {-wj - 1} of prompt {wi}" if wj < 0 else f"token {wj} of prompt {wi}"
    if not mean <= request.bound:
        raise ProbeFailed(
            f"{engine}: update {version!r} failed the log-prob probe: the engine's forward on "
            f"the staged weights scores {len(scored)} probe tokens {mean:.4g} nats away from "
            f"the trainer's on average (bound {request.bound:g}; worst {worst_gap:.4g} at "
            f"{where}); its loader put some tensor where the model does not read it (swapped, "
            f"transposed or dropped). The update is not committed."
        )
    if wj < 0 and worst_gap == math.inf:
        step = -wj - 1
        mine = decoded[wi].tokens[step] if step < len(decoded[wi].tokens) else None
        raise ProbeFailed(
            f"{engine}: update {version!r} failed the log-prob probe: at {where} the engine's "
            f"greedy decode on the staged weights chose token {mine} where the trainer's chose "
            f"{request.decode_tokens[wi][step]}, which is not among the engine's {DECODE_TOP} "
            f"most likely there; some tensor the engine decodes with (its KV cache, a tensor "
            f"derived after loading) is not the trainer's. The update is not committed."
        )
    if request.max_bound is not None and not worst_gap <= request.max_bound:
        raise ProbeFailed(
            f"{engine}: update {version!r} failed the log-prob probe: the engine's forward on "
            f"the staged weights scores {where} {worst_gap:.4g} nats away from the trainer's "
            f"(max_bound {request.max_bound:g}; mean over {len(scored)} tokens {mean:.4g}, "
            f"within its bound {request.bound:g}); some tensor the model reads for it (an "
            f"embedding row, an expert, a tensor derived for decode) is not the trainer's. The "
            f"update is not committed."
        )
    return report


def _decode_gaps(request: ProbeRequest, decoded: Sequence[Decoded]) -> list[tuple[float, int, int]]:
    """(gap, prompt, step) of each decode step scored: up to and including the first step
    where the engine chose another token than the trainer (scored by the engine's log-prob of
    the trainer's token among its most likely; not found: an infinite gap)."""
    gaps = []
    for i, (want, want_lp, mine) in enumerate(
        zip(request.decode_tokens, request.decode_expected, decoded)
    ):
        for j, (token, expected) in enumerate(zip(want, want_lp)):
            same = j < len(mine.tokens) and mine.tokens[j] == token
            if same:
                logprob = float(mine.logprobs[j])
            else:
                logprob = (
                    dict(mine.top[j]).get(token, -math.inf) if j < len(mine.top) else -math.inf
                )
            gap = abs(logprob - expected) if math.isfinite(logprob) else math.inf
            gaps.append((gap, i, j))
            if not same:
                break
    return gaps


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


def greedy_causal_lm(model: Any, tokens: list[list[int]], steps: int) -> list[Decoded]:
    """Per prompt, `steps` tokens chosen greedily by a causal LM called as
    `model(input_ids=ids)` (each step a forward over the prompt and the tokens chosen so far),
    with their float32 log-probs and the `DECODE_TOP` most likely at each step. Every process
    holding a shard of `model` must call it (the choices depend only on the logits, which
    every process computes alike)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out: list[Decoded] = []
        with torch.no_grad():
            for prompt in tokens:
                ids = list(prompt)
                chosen: list[int] = []
                logprobs: list[float] = []
                top: list[list[tuple[int, float]]] = []
                for _ in range(steps):
                    result = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device))
                    logits = getattr(result, "logits", result)
                    if hasattr(logits, "full_tensor"):
                        logits = logits.full_tensor()
                    logp = torch.log_softmax(logits[0, -1].float(), dim=-1).cpu()
                    values, indices = logp.topk(DECODE_TOP)
                    token = int(indices[0])
                    chosen.append(token)
                    logprobs.append(float(values[0]))
                    top.append([(int(t), float(v)) for t, v in zip(indices, values)])
                    ids.append(token)
                out.append(Decoded(tokens=chosen, logprobs=logprobs, top=top))
        return out
    finally:
        model.train(was_training)
