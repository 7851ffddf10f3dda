"""Checkpoint layouts for benchmarks (weightsync/apps/layouts.py): the real models' counts and sizes,
and `shrink`, which CPU benchmarks rely on to run the same many-tensor layouts in little memory."""

from __future__ import annotations

import pytest

from weightsync.apps import layouts


def test_real_layouts_have_the_checkpoints_tensor_counts_and_sizes():
    llama = layouts.layout("llama8b")
    moe = layouts.layout("qwen3-30b-a3b")
    assert (len(llama), round(layouts.nbytes(llama) / 1e9, 1)) == (291, 16.1)
    assert (len(moe), round(layouts.nbytes(moe) / 1e9, 1)) == (18867, 61.1)
    assert len(layouts.layout("qwen3-30b-a3b", num_layers=24)) == 9435
    mla = layouts.layout("mla-moe")
    assert (len(mla), round(layouts.nbytes(mla) / 1e12, 2)) == (69975, 2.05)
    assert len(layouts.layout("mla-moe", num_experts=1152)) == 208215  # >= 200k tensors
    assert round(layouts.nbytes(layouts.layout("mla-moe", shrink=8)) / 1e9) == 32
    # The simulator's models (weightsync/apps/scale.py): parameters, in billions.
    v3, l70 = layouts.layout("deepseek-v3"), layouts.layout("llama70b")
    assert (len(v3), round(layouts.nbytes(v3, 1) / 1e9, 1)) == (45395, 671.0)
    assert (len(l70), round(layouts.nbytes(l70, 1) / 1e9, 1)) == (723, 70.6)


@pytest.mark.parametrize("name", ["llama8b", "qwen3-30b-a3b", "mla-moe"])
def test_shrink_keeps_every_name_and_divides_the_bytes_by_about_its_square(name):
    real = layouts.layout(name, num_layers=4)
    small = layouts.layout(name, num_layers=4, shrink=4)
    assert [n for n, _ in small] == [n for n, _ in real]
    assert all(
        len(s) == len(r) and all(a <= b for a, b in zip(s, r))
        for (_, s), (_, r) in zip(small, real)
    )
    ratio = layouts.nbytes(real) / layouts.nbytes(small)
    assert 12 < ratio <= 16.5, ratio  # about 16: widths are floored after dividing


def test_shrink_below_one_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"shrink=0: must be an int >= 1"):
        layouts.layout("llama8b", shrink=0)
