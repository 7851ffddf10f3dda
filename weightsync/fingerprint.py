"""Per-tensor fingerprints, computed the same way on the trainer and inside an engine.

A fingerprint is two wrapping 64-bit sums over the tensor's bytes read as signed 16-bit words
(unsigned bytes for 1-byte dtypes): the sum of the words and the sum of their squares. Both are
exact (integer, so the same on any device, thread count or torch release) and additive, which is
what lets an engine check a parameter it stores in another layout: a fused QKV parameter's
fingerprint is the sum of the q, k and v fingerprints, a transposed weight's equals the original's
(elements move whole, and with them their words), and the zero rows an engine pads a vocabulary
with add nothing. One changed element always changes the first sum. What the sums cannot see is a
permutation of elements; the generation check catches those.

Verification compares the two ends through the refit check's map of trainer tensor -> engine
parameters: the engine reports `model_fingerprints`, the sender computes `expected_fingerprints`
from what it sent.

Speed: on CPU each chunk is widened to float64 and reduced with torch's sum and BLAS dot, ~5 GB/s
on one core and ~10 GB/s on two (numpy int64 sums ran at ~2 GB/s). Exactness holds because every
partial result is an integer below 2**53: a chunk of 2**20 words sums to at most 2**35 and its
squares to at most 2**50, whatever order the BLAS adds them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

MASK = (1 << 64) - 1
_CPU_CHUNK_WORDS = 1 << 20  # keeps every float64 partial sum exact (see above)
_GPU_CHUNK_WORDS = 1 << 26

Fingerprint = tuple[int, int]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool or flat.element_size() == 1:
        return flat.view(torch.uint8)
    return flat.view(torch.int16)


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """(sum of the 16-bit words, sum of their squares), each mod 2**64."""
    if tensor.numel() == 0:
        return (0, 0)
    if tensor.device.type != "cpu":
        s1, s2 = _device_sums(tensor).tolist()
        return (s1 & MASK, s2 & MASK)
    words = _words(tensor)
    s1 = s2 = 0
    scratch = torch.empty(min(words.numel(), _CPU_CHUNK_WORDS), dtype=torch.float64)
    for chunk in words.split(_CPU_CHUNK_WORDS):
        wide = scratch[: chunk.numel()]
        wide.copy_(chunk)
        s1 += int(wide.sum())
        s2 += int(torch.dot(wide, wide))
    return (s1 & MASK, s2 & MASK)


def fingerprints(tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """`fingerprint` of each tensor. GPU tensors are reduced on their device without a host
    round trip per tensor (integer sums, wrapping like the results: exact, whatever the
    reduction order) and read back together at the end."""
    out: list[Fingerprint | None] = [None] * len(tensors)
    pending: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0 or tensor.device.type == "cpu":
            out[i] = fingerprint(tensor)
            continue
        pending.setdefault(tensor.device, []).append((i, _device_sums(tensor)))
    for items in pending.values():
        sums = torch.stack([pair for _, pair in items]).tolist()
        for (i, _), (s1, s2) in zip(items, sums):
            out[i] = (s1 & MASK, s2 & MASK)
    return out  # type: ignore[return-value]


def _device_sums(tensor: torch.Tensor) -> torch.Tensor:
    """[sum of the words, sum of their squares] as an int64 tensor on the tensor's device
    (wrapping mod 2**64, as the results do)."""
    total = None
    for chunk in _words(tensor).split(_GPU_CHUNK_WORDS):
        wide = chunk.to(torch.int32)  # a square of a 16-bit word fits in 31 bits
        pair = torch.stack([chunk.sum(dtype=torch.int64), wide.mul_(wide).sum(dtype=torch.int64)])
        total = pair if total is None else total + pair
    return total


def combine(prints: list[Fingerprint]) -> Fingerprint:
    """The fingerprint of the concatenation of tensors with these fingerprints."""
    return (sum(p[0] for p in prints) & MASK, sum(p[1] for p in prints) & MASK)


def diff(expected: dict[str, Fingerprint], actual: dict[str, Fingerprint]) -> list[str]:
    """Names whose fingerprints differ or are missing on one side, sorted."""
    names = set(expected) | set(actual)
    return sorted(
        n for n in names
        if n not in expected or n not in actual or tuple(expected[n]) != tuple(actual[n])
    )


def expected_fingerprints(param_of: dict[str, list[str]],
                          sent: dict[str, Fingerprint]) -> dict[str, Fingerprint]:
    """What each engine parameter's fingerprint must be, from the trainer tensors' fingerprints.

    A trainer tensor that lands in several engine parameters cannot be checked this way and is
    left out (its parameters are then compared through their other tensors only if exclusive).
    """
    parts: dict[str, list[Fingerprint]] = {}
    shared: set[str] = set()
    for name, targets in param_of.items():
        if len(targets) != 1:
            shared.update(targets)
            continue
        parts.setdefault(targets[0], []).append(tuple(sent[name]))
    return {p: combine(prints) for p, prints in parts.items() if p not in shared}


def model_fingerprints(model: nn.Module,
                       param_of: dict[str, list[str]]) -> dict[str, list[int]]:
    """Engine side: {parameter name: [s1, s2]} of every parameter some trainer tensor lands in
    (`param_of`: trainer tensor -> engine parameters), as plain data."""
    covered = {p for targets in param_of.values() for p in targets}
    named = [(name, p.data) for name, p in model.named_parameters() if name in covered]
    prints = fingerprints([t for _, t in named])
    return {name: list(fp) for (name, _), fp in zip(named, prints)}
