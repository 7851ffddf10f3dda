from __future__ import annotations

import pytest
import torch

from weightsync.wire.fingerprint import (
    MASK,
    PRIMES,
    ROOTS,
    FingerprintBatch,
    KeptHashes,
    ModelPrints,
    combine,
    fingerprint,
    fingerprints,
    model_fingerprints,
    placed,
    shift,
    words_per_element,
)
from weightsync.wire.placement import pattern_view


def _reference(tensor: torch.Tensor) -> tuple[int, int, int]:
    """The definition, in Python integers."""
    flat = tensor.reshape(-1).contiguous()
    words = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16).tolist()
    return (sum(words) & MASK,) + tuple(
        sum(x * pow(r, j, p) for j, x in enumerate(words)) % p for p, r in zip(PRIMES, ROOTS)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_one_changed_element_changes_the_fingerprint(dtype):
    x = (torch.randn(64, 33) * 100).to(dtype)
    y = x.clone()
    # A value the element does not hold (x + 1 rounds back to x in bfloat16 beyond 256).
    y.view(-1)[1234] = 7 if x.view(-1)[1234] != 7 else 9
    assert not torch.equal(x, y)
    assert fingerprint(x) != fingerprint(y)


def test_a_transposed_tensor_has_another_fingerprint_but_its_layout_does_not_matter():
    x = torch.randn(17, 9).bfloat16()
    assert fingerprint(x) != fingerprint(x.t().contiguous())
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())
    assert fingerprint(torch.randn(3, 70000)[:, ::2]) is not None  # strided flat view


def test_swapped_rows_and_swapped_q_k_change_the_fingerprint():
    x = torch.randn(16, 8)
    swapped = x.clone()
    swapped[[3, 11]] = x[[11, 3]]
    assert fingerprint(swapped) != fingerprint(x)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    assert fingerprint(torch.cat([q[4:], q[:4], k, v])) != fingerprint(torch.cat([q, k, v]))
    assert fingerprint(torch.cat([k, q[:4], q[4:], v])) != fingerprint(torch.cat([q, k, v]))


def test_a_fused_parameter_is_the_combination_of_its_parts_shifted_where_they_sit():
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)
    words = words_per_element(torch.float32)
    parts = [
        shift(fingerprint(q), 0),
        shift(fingerprint(k), 32 * words),
        shift(fingerprint(v), 48 * words),
    ]
    assert fingerprint(torch.cat([q, k, v])) == combine(parts)
    assert fingerprint(torch.cat([k, q, v])) != combine(parts)


def test_zero_padding_at_the_end_does_not_change_the_fingerprint():
    x = torch.randn(5, 4)
    assert fingerprint(x) == fingerprint(torch.cat([x, torch.zeros(3, 4)]))


def test_placed_runs_equal_the_fingerprint_of_the_slice_where_it_sits():
    full = torch.randn(6, 8).bfloat16()
    param = torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    param[1] = full[:, 4:]  # columns 4..7 of each row, into the second half of a parameter
    pattern = [24, 4, 4, 6, 4, 8]  # [dst, src, length, count, dst_stride, src_stride]
    runs = pattern_view(full.reshape(-1), pattern)
    assert combine([placed(runs, pattern[0], pattern[4])]) == fingerprint(param)
    assert combine([placed(runs, 0, pattern[4])]) != fingerprint(param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_fingerprint_is_exact_against_the_definition(dtype):
    # Several GEMM rows plus a tail, with extreme words, so a lost bit would show.
    x = torch.randint(-32768, 32767, ((3 << 16) + 78,), dtype=torch.int16)
    x[:1000] = -32768
    x[1000:2000] = 32767
    x = x.view(torch.uint8) if dtype == torch.uint8 else x.view(dtype)
    assert fingerprint(x) == _reference(x)


def test_placed_runs_longer_than_a_gemm_row_are_exact():
    src = torch.randint(-32768, 32767, (3, 70001), dtype=torch.int16).view(torch.bfloat16)
    param = torch.zeros(3, 80000, dtype=torch.bfloat16)
    param[:, 5:70006] = src
    pattern = [5, 0, 70001, 3, 80000, 70001]
    got = combine([placed(pattern_view(src.reshape(-1), pattern), pattern[0], pattern[4])])
    assert got == _reference(param)


@pytest.mark.gpu
def test_gpu_fingerprints_equal_the_cpu_ones_exactly():
    from weightsync.wire.fingerprint import fingerprints

    gen = torch.Generator().manual_seed(0)
    cpu = [
        torch.randn(1000, generator=gen).to(torch.bfloat16),
        torch.randn(33, 7, generator=gen),  # float32: two words per element
        torch.randint(-128, 127, (999,), dtype=torch.int8, generator=gen),
        torch.zeros(0, dtype=torch.bfloat16),
        torch.full((4096,), -3.0e38),  # large words
        torch.randn((1 << 25) + 5, generator=gen).to(torch.bfloat16),
    ]  # many rows + a tail
    got = fingerprints([t.cuda() for t in cpu])
    assert got == [fingerprint(t) for t in cpu]
    assert fingerprint(cpu[1].cuda()) == fingerprint(cpu[1])
    runs = cpu[5][: 4096 * 6].view(6, 4096)[:, 100:3000]
    assert placed(runs.cuda(), 7, 5000) == placed(runs, 7, 5000)


@pytest.mark.gpu
def test_the_gpu_word_sum_kernel_gives_the_gemms_fingerprints(monkeypatch):
    """The Triton kernel (weightsync/gpu/word_sums.py) and the GEMM give the same integers, over
    many tensors of mixed lengths and word sizes hashed together, and the kernel path ran."""
    from weightsync.gpu import word_sums
    from weightsync.wire import fingerprint as fp

    assert word_sums.available(), "Triton should run on a CUDA build of torch"
    gen = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(n, generator=gen).to(dtype).cuda()
        for n, dtype in [
            (3 * (1 << 16) + 17, torch.bfloat16),
            (70 * (1 << 16) + 3, torch.bfloat16),  # three groups of rows
            (1, torch.bfloat16),
            (0, torch.bfloat16),
            (4096, torch.float32),
            ((1 << 16) - 1, torch.bfloat16),
            (5000, torch.float8_e4m3fn),
            ((1 << 17) + 1, torch.float8_e4m3fn),
        ]
    ]
    tensors += [torch.full((777,), v, dtype=torch.bfloat16).cuda() for v in (-3.0e38, 3.0e38)]
    ran = []
    real = word_sums.group_sums
    monkeypatch.setattr(word_sums, "group_sums", lambda *a, **k: ran.append(1) or real(*a, **k))
    with_kernel = fp.fingerprints(tensors)
    assert ran
    monkeypatch.setattr(fp, "KERNEL", False)
    assert with_kernel == fp.fingerprints(tensors)
    assert with_kernel[3] == _reference(tensors[3].cpu())


def test_a_float32_change_that_keeps_the_word_sum_moves_both_hashes():
    """+1 in one 16-bit word of a float32 element and -1 in the other: `s` stays, h1 and h2
    move (the module doc's claim for elements of up to 4 bytes)."""
    base = torch.randn(64, generator=torch.Generator().manual_seed(0))
    base[5] = 1.5  # words 0x0000 and 0x3FC0: neither wraps around
    changed = base.clone()
    words = changed.view(torch.int16)
    words[10] += 1  # the element 5's two words, in memory order
    words[11] -= 1
    assert not torch.equal(base, changed)
    before, after = fingerprint(base), fingerprint(changed)
    assert before[0] == after[0]
    assert before[1] != after[1] and before[2] != after[2]


def _kept_tensors(device="cpu"):
    gen = torch.Generator().manual_seed(3)
    made = [
        torch.randn(5, 7, generator=gen).bfloat16(),
        torch.randn(5, 7, generator=gen).bfloat16(),  # a group of equal lengths
        torch.randn(3, 70001, generator=gen),  # more than one row of words
        torch.randint(0, 255, (9,), generator=gen).to(torch.uint8),
        torch.rand(11, generator=gen) > 0.5,
        torch.empty(0, dtype=torch.float16),
    ]
    return [t.to(device) for t in made]


def _kept_round(tensors, kept):
    batch = FingerprintBatch()
    batch.add_all(tensors, kept)
    return batch.read()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kept_hashes_hash_the_same_tensors_again_with_their_values_then(device):
    """`FingerprintBatch.add_all` with `KeptHashes`: the second call on the same list reuses
    the groups made by the first, and gives the fingerprints of the values the tensors hold
    then (they are read again, not remembered); a list holding a tensor hashed through a
    contiguous copy is not kept."""
    tensors = _kept_tensors(device)
    kept = KeptHashes()
    assert _kept_round(tensors, kept) == fingerprints(tensors)
    assert kept.tensors is tensors and kept.flushes
    with torch.no_grad():
        for t in tensors:
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.numel():
                t.view(-1)[0] += 1
    groups = kept.flushes
    assert _kept_round(tensors, kept) == fingerprints(tensors)
    assert kept.flushes is groups  # reused, not made again
    strided = [torch.randn(6, 4, device=device)[:, ::2]]
    kept = KeptHashes()
    assert _kept_round(strided, kept) == fingerprints(strided) and kept.tensors is None


def test_model_prints_follow_a_parameter_whose_memory_moved():
    """`ModelPrints` keeps its parameter list and hashing between calls, and still hashes a
    parameter given new memory (`param.data = ...`) and values written in place."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    param_of = {n: [n] for n, _ in model.named_parameters()}
    prints = ModelPrints(model)
    assert prints(param_of) == model_fingerprints(model, param_of)
    with torch.no_grad():
        model[0].weight.add_(1)
        model[1].bias.data = torch.randn(2)
    assert prints(param_of) == model_fingerprints(model, param_of)
    learned = {"0.weight": ["0.weight"]}
    assert prints(learned) == {"0.weight": list(fingerprint(model[0].weight))}
    learned["1.bias"] = ["1.bias"]  # an engine that learns its map while loading adds to it
    assert prints(learned) == model_fingerprints(model, learned) and len(prints(learned)) == 2
