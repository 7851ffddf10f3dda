"""What an engine actor's `generate` is asked to sample, checked before any request is sent.

Both engine actors take these as keyword arguments of `generate` and build a `SamplingOptions`
first, so an option an engine cannot honour is a ValueError in the caller (and, when the driver
builds one itself, before any engine is reached). Each option is passed to the engine's own
sampling parameters (vLLM `SamplingParams` or its completions request, SGLang's
`sampling_params`); the ranges are those both engines accept. `n` samples per prompt come back
grouped by prompt: rows `i * n ... i * n + n - 1` belong to prompt `i`.

A sample ends at the model's end-of-sequence token (config.json and generation_config.json
`eos_token_id`, and the tokenizer's), at a `stop_token_ids` token or a `stop` string (the token
that ends it is kept), or after `max_new_tokens`; `ignore_eos=True` gives exactly
`max_new_tokens` tokens unless a stop string matches first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.wire.probe import DECODE_TOP, Decoded

MAX_TOP_LOGPROBS = 20
"""vLLM's default `max_logprobs`: it refuses more per position."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingOptions:
    """How to sample completions of a batch of prompts."""

    max_new_tokens: int = 8
    """Most tokens generated per sample; exactly this many with `ignore_eos` and no stop."""
    min_new_tokens: int = 0
    """Neither EOS nor `stop_token_ids` ends a sample before this many tokens."""
    temperature: float = 0.0
    """0 is greedy; the softmax of logits / temperature otherwise, in [0, 2]."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Sample among the top_k most likely tokens; 0 keeps every token."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]; 0 keeps all."""
    repetition_penalty: float = 1.0
    """Logits of tokens already in the prompt or output divided (if > 0) or multiplied by it,
    in (0, 2]; 1 is none."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of each token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per earlier occurrence of a token in the output, in [-2, 2]."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Seed of sample j of each prompt: seed + j. vLLM honours it; SGLang only when started with
    enable_deterministic_inference (it ignores per-request seeds otherwise)."""
    ignore_eos: bool = False
    """Go on past the model's end-of-sequence token (for a fixed number of tokens per sample)."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample once its decoded text contains one (a str or a list is taken
    too). The tokens come back up to the one that completed the string."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample, as EOS does; the id is the sample's last token."""
    top_logprobs: int = 0
    """How many of the most likely tokens' log-probabilities to return at each position
    (vLLM's `logprobs`, SGLang's `top_logprobs_num`), at most 20; 0 returns none."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens!r}: must be an int in [0, "
                f"max_new_tokens={self.max_new_tokens}]"
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 2:
            raise ValueError(
                f"temperature={self.temperature!r}: must be in [0, 2] (0 is greedy; vLLM "
                f"refuses more than 2)"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 keeps every token)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an int >= 1, or 0 for every token")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r}: must be in [0, 1] (0 keeps every token)")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r}: must be in (0, 2] (1 is no "
                f"penalty; SGLang refuses more than 2)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r}: must be in [-2, 2] (0 is no penalty)")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an int >= 1 (samples per prompt)")
        if self.n > 1 and self.greedy:
            raise ValueError(
                f"n={self.n} with temperature=0: greedy samples of a prompt are all the same "
                f"(vLLM refuses them); set temperature > 0 or n=1"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be an int or None")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be True or False")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r}: must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={ids!r}: must be a list of token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(
                f"stop_token_ids={list(self.stop_token_ids)} with ignore_eos=True: SGLang "
                f"ignores stop_token_ids when ignore_eos is set (vLLM does not), so the engines "
                f"would differ; drop ignore_eos (EOS then ends samples too) or the ids"
            )
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs={self.top_logprobs!r}: must be an int in [0, "
                f"{MAX_TOP_LOGPROBS}] (vLLM's default max_logprobs)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True, slots=True, frozen=True)
class Sample:
    """One completion as an engine actor read it from its engine."""

    tokens: list[int]
    logprobs: list[float]
    """Of each sampled token."""
    finish_reason: str
    """Why it ended: "stop" (EOS, a stop token or string), "length" (max_new_tokens), or the
    engine's own word (e.g. "abort")."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """At each position, (token id, log-probability) of the most likely tokens, most likely
    first; only when `SamplingOptions.top_logprobs` asked for them."""


def generate_answer(
    samples: list[Sample], *, weight_version: str | None, options: SamplingOptions
) -> dict[str, Any]:
    """An engine actor's `generate` answer: a row per sample, grouped by prompt, in "tokens",
    "logprobs" and "finish_reasons"; "top_logprobs" (rows of [(token id, log-probability)] per
    position) when asked; and the "weight_version" that served them."""
    answer: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "logprobs": [s.logprobs for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
        "weight_version": weight_version,
    }
    if options.top_logprobs:
        answer["top_logprobs"] = [s.top_logprobs or [] for s in samples]
    return answer


def probe_decoding(steps: int) -> SamplingOptions:
    """A probe's decode steps (weightsync/wire/probe.py): `steps` greedy tokens whatever they
    are, with the `DECODE_TOP` most likely at each."""
    return SamplingOptions(
        max_new_tokens=steps,
        min_new_tokens=steps,
        temperature=0.0,
        ignore_eos=True,
        top_logprobs=DECODE_TOP,
    )


def as_decoded(samples: list[Sample]) -> list[Decoded]:
    """An engine's samples of `probe_decoding` as the probe's check reads them."""
    return [
        Decoded(tokens=s.tokens, logprobs=s.logprobs, top=s.top_logprobs or []) for s in samples
    ]
