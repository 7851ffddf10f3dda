"""Per-tensor fingerprints, computed the same way on the trainer and inside an engine.

A fingerprint is two wrapping 64-bit sums over the tensor's elements, read as integers of their
own width: the sum of the bit patterns and the sum of their squares. Both are exact (integer, so
the same on any device, thread count or torch release) and additive, which is what lets an
engine check a parameter it stores in another layout: a fused QKV parameter's fingerprint is the
sum of the q, k and v fingerprints, a transposed weight's equals the original's, and the zero rows
an engine pads a vocabulary with add nothing. One changed element always changes the first sum.
What the sums cannot see is a permutation of elements; the generation check catches those.
"""

from __future__ import annotations

import numpy as np
import torch

MASK = (1 << 64) - 1
# Chunks small enough to stay in cache once widened to int64; numpy's integer dot and sum run
# ~3x faster than torch's int64 reductions on CPU.
_CPU_CHUNK_ELEMENTS = 1 << 18
_GPU_CHUNK_ELEMENTS = 1 << 26
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Fingerprint = tuple[int, int]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """(sum of element bits, sum of their squares), each mod 2**64."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return (0, 0)
    if flat.dtype == torch.bool:
        bits = flat.view(torch.uint8)
    else:
        bits = flat.view(_INT_OF_WIDTH[flat.element_size()])
    s1 = s2 = 0
    if bits.device.type == "cpu":
        array = bits.numpy()
        for start in range(0, array.size, _CPU_CHUNK_ELEMENTS):
            wide = array[start : start + _CPU_CHUNK_ELEMENTS].astype(np.int64)
            s1 += int(wide.sum())
            s2 += int(np.dot(wide, wide))
    else:
        for chunk in bits.split(_GPU_CHUNK_ELEMENTS):
            wide = chunk.to(torch.int64)
            s1 += int(wide.sum())
            s2 += int(wide.mul_(wide).sum())
    return (s1 & MASK, s2 & MASK)


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
