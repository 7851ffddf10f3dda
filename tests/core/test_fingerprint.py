from __future__ import annotations

import pytest
import torch

from weightsync.fingerprint import combine, fingerprint


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_one_changed_element_changes_the_fingerprint(dtype):
    x = (torch.randn(64, 33) * 100).to(dtype)
    y = x.clone()
    y.view(-1)[1234] += 1
    assert fingerprint(x) != fingerprint(y)


def test_fingerprint_is_independent_of_layout():
    x = torch.randn(17, 9).bfloat16()
    assert fingerprint(x) == fingerprint(x.t()) == fingerprint(x.t().contiguous())


def test_fused_tensor_fingerprint_is_the_combination_of_its_parts():
    q, k, v = (torch.randn(8, 4) for _ in range(3))
    assert fingerprint(torch.cat([q, k, v])) == combine([fingerprint(t) for t in (q, k, v)])


def test_zero_padding_does_not_change_the_fingerprint():
    x = torch.randn(5, 4)
    assert fingerprint(x) == fingerprint(torch.cat([x, torch.zeros(3, 4)]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_fingerprint_is_exact_against_integer_sums(dtype):
    # Large enough for several chunks, with extreme words, so a lost bit in the float64
    # reduction would show.
    x = torch.randint(-32768, 32767, (3 << 20,), dtype=torch.int16)
    x[:1000] = -32768
    x = x.view(torch.uint8) if dtype == torch.uint8 else x.view(dtype)
    ints = x.view(torch.uint8) if dtype == torch.uint8 else x.view(torch.int16)
    wide = [int(v) for v in ints.tolist()]
    mask = (1 << 64) - 1
    assert fingerprint(x) == (sum(wide) & mask, sum(v * v for v in wide) & mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fingerprints_equal_the_cpu_ones_exactly():
    from weightsync.fingerprint import _GPU_CHUNK_WORDS, fingerprints

    gen = torch.Generator().manual_seed(0)
    cpu = [torch.randn(1000, generator=gen).to(torch.bfloat16),
           torch.randn(33, 7, generator=gen),  # float32: two words per element
           torch.randint(-128, 127, (999,), dtype=torch.int8, generator=gen),
           torch.zeros(0, dtype=torch.bfloat16),
           torch.full((4096,), -3.0e38),  # large words: sums of squares wrap past 2**63
           torch.randn(_GPU_CHUNK_WORDS + 5, generator=gen).to(torch.bfloat16)]  # two chunks
    got = fingerprints([t.cuda() for t in cpu])
    assert got == [fingerprint(t) for t in cpu]
    assert fingerprint(cpu[1].cuda()) == fingerprint(cpu[1])
