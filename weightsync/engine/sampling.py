"""What an engine actor's `generate` is asked to sample, checked before any request is sent.

Both engine actors take these as keyword arguments of `generate` and build a `SamplingOptions`
first, so an option an engine cannot honour is a ValueError in the caller (and, when the driver
builds one itself, before any engine is reached). `n` samples per prompt come back grouped by
prompt: rows `i * n ... i * n + n - 1` belong to prompt `i`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingOptions:
    """How to sample completions of a batch of prompts."""

    max_new_tokens: int = 8
    """Tokens generated per sample (end-of-sequence is ignored, so always exactly this many)."""
    temperature: float = 0.0
    """0 is greedy; the softmax of logits / temperature otherwise."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Seed of sample j of each prompt: seed + j. vLLM honours it; SGLang only when started with
    enable_deterministic_inference (it ignores per-request seeds otherwise)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 is greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 keeps every token)")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an int >= 1 (samples per prompt)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be an int or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
