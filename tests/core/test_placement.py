"""Placements: which elements of a trainer tensor a tensor-parallel worker's loader keeps, and
where, learned from the loader alone (weightsync/wire/placement.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync.wire.fingerprint import fingerprint
from weightsync.wire.placement import (
    expected_worker_fingerprints,
    learn_placement,
    pattern_view,
    patterns,
)


def _param(shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(shape).to(dtype), requires_grad=False)


def _apply(param, tensor, pats):
    """Write `tensor` into `param` through the patterns, as a one-copy writer would."""
    flat_p, flat_t = param.data.reshape(-1), tensor.reshape(-1)
    for p in pats:
        pattern_view(flat_p, p, dst=True).copy_(pattern_view(flat_t, p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_parallel_slices_are_found(dtype, rank):
    full = torch.randn(6, 8).to(dtype)
    col = _param((3, 8), dtype)  # rows [3*rank, 3*rank+3)
    row = _param((6, 4), dtype)  # columns [4*rank, 4*rank+4)
    live_col, live_row = col.data.clone(), row.data.clone()

    def load_col(t):
        col.data.copy_(t.narrow(0, 3 * rank, 3))

    def load_row(t):
        row.data.copy_(t.narrow(1, 4 * rank, 4))

    pc = learn_placement(col, dtype, (6, 8), load_col)
    pr = learn_placement(row, dtype, (6, 8), load_row)
    assert pc == [[0, 24 * rank, 24, 1, 0, 0]]
    assert pr == [[0, 4 * rank, 4, 6, 4, 8]]  # one run of 4 per row
    # The live weights were never touched.
    assert torch.equal(col.data, live_col) and torch.equal(row.data, live_row)
    _apply(col, full, pc)
    _apply(row, full, pr)
    assert torch.equal(col.data, full.narrow(0, 3 * rank, 3))
    assert torch.equal(row.data, full.narrow(1, 4 * rank, 4))
    want = expected_worker_fingerprints(
        {"c": full, "r": full}, {"c": ("col", pc), "r": ("row", pr)}
    )
    assert want == {"col": fingerprint(col.data), "row": fingerprint(row.data)}


def test_a_fused_parameter_takes_each_tensor_slice_at_its_offset():
    q, k = torch.randn(8, 4), torch.randn(4, 4)
    qkv = _param((4 + 2, 4))  # rank 1 of 2: q rows 4..8, k rows 2..4

    def load(name):
        def one(t):
            if name == "q":
                qkv.data[:4].copy_(t[4:8])
            else:
                qkv.data[4:].copy_(t[2:4])

        return one

    pq = learn_placement(qkv, torch.float32, (8, 4), load("q"))
    pk = learn_placement(qkv, torch.float32, (4, 4), load("k"))
    assert pq == [[0, 16, 16, 1, 0, 0]] and pk == [[16, 8, 8, 1, 0, 0]]
    want = expected_worker_fingerprints({"q": q, "k": k}, {"q": ("qkv", pq), "k": ("qkv", pk)})
    qkv.data[:4].copy_(q[4:8])
    qkv.data[4:].copy_(k[2:4])
    assert want == {"qkv": fingerprint(qkv.data)}


def test_large_tensors_take_several_passes():
    n = 70_000  # more than 2**15 elements of a 2-byte dtype: two passes
    param = _param((n // 2,), torch.bfloat16)
    pats = learn_placement(param, torch.bfloat16, (n,), lambda t: param.data.copy_(t[n // 2 :]))
    assert pats == [[0, n // 2, n // 2, 1, 0, 0]]


def test_a_loader_that_converts_or_transforms_has_no_placement():
    param = _param((4, 4))
    assert learn_placement(param, torch.float32, (4, 4), lambda t: param.data.copy_(t * 2)) is None
    assert (
        learn_placement(param, torch.bfloat16, (4, 4), lambda t: param.data.copy_(t)) is None
    )  # dtype differs
    transposed = learn_placement(param, torch.float32, (4, 4), lambda t: param.data.copy_(t.t()))
    full = torch.randn(4, 4)
    _apply(param, full, transposed)  # a permutation is a placement too
    assert torch.equal(param.data, full.t())


def test_patterns_compress_rows_and_keep_irregular_runs():
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    src = torch.tensor([2, 3, 6, 7, 10, 11, 0])
    assert patterns(dst, src) == [[0, 2, 2, 3, 2, 4], [9, 0, 1, 1, 0, 0]]


@pytest.mark.parametrize("cuts", [[0, 48], [0, 5, 48], [0, 3, 13, 14, 30, 47, 48], [0, 1, 2, 48]])
def test_pieces_of_a_tensor_land_where_the_patterns_say(cuts):
    """A trainer rank writes its piece (a contiguous element range of the full tensor) into a
    tensor-parallel worker's parameter: every piece boundary, including ones inside a run."""
    from weightsync.trainer.one_copy.targets import placed_pieces

    full = torch.arange(48, dtype=torch.int32).reshape(6, 8)
    for narrow in (lambda t: t.narrow(1, 4, 4), lambda t: t.narrow(0, 2, 3), lambda t: t.t()[2:5]):
        want = narrow(full).contiguous()
        param = torch.nn.Parameter(torch.zeros_like(want), requires_grad=False)
        pats = learn_placement(
            param, torch.int32, (6, 8), lambda t, p=param, f=narrow: p.data.copy_(f(t))
        )
        dst = torch.full((want.numel(),), -1, dtype=torch.int32)
        flat = full.reshape(-1)
        for a, b in zip(cuts, cuts[1:]):
            for d_view, s_view in placed_pieces(dst, flat[a:b].clone(), a, pats):
                d_view.copy_(s_view)
        assert torch.equal(dst.view_as(want), want)


def sliced_model(full: torch.nn.Module, rank: int, size: int) -> torch.nn.Module:
    """A tensor-parallel worker's copy of `full`: every 2-D weight cut along dim 0 (even layers)
    or dim 1 (odd ones), each parameter's loader keeping this rank's slice."""
    model = torch.nn.Module()
    for i, (name, p) in enumerate(full.named_parameters()):
        dim = i % 2 if p.dim() == 2 else 0
        shape = list(p.shape)
        shape[dim] //= size
        param = torch.nn.Parameter(torch.zeros(shape, dtype=p.dtype), requires_grad=False)

        def loader(param, tensor, dim=dim):
            n = param.shape[dim]
            param.data.copy_(tensor.narrow(dim, rank * n, n))

        param.weight_loader = loader
        model.register_parameter(name, param)
    return model


def test_two_sliced_workers_are_each_verified_against_what_they_hold():
    """The reference receiver with slicing loaders stands for two TP workers (the GPU script's
    tensor-parallel mode runs the same over CUDA IPC): each learns its placements during the
    first sync, and the sender checks each against the trainer's elements it holds."""
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.trainer.endpoint import LocalEndpoint
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.source import DTensorV2Source
    from weightsync.transports.shm import ShmSender
    from weightsync.wire.placement import WorkerPrints

    torch.manual_seed(0)
    full = torch.nn.Module()
    for i in range(4):
        full.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(8, 6)))
    source = DTensorV2Source(full)
    workers = [
        ModuleWeightReceiver(sliced_model(full, r, 2), name=f"w{r}", sliced=True) for r in range(2)
    ]
    sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
    try:
        for r, worker in enumerate(workers):
            sender.add_engine(LocalEndpoint(worker, name=f"tp{r}"))
        report = sender.sync(source.tensors(), version="v1", verify=True)
        assert report.verify["tp0"].pending  # needs the tensors again, with placements

        def check():
            expected = {n: WorkerPrints(sender.engines[n].placements) for n in ("tp0", "tp1")}
            sent = {}
            for name, tensor in source.tensors():
                sent[name] = fingerprint(tensor)
                for prints in expected.values():
                    prints.add(name, tensor)
            return sender.verify(
                sent,
                engines=["tp0", "tp1"],
                worker_sent={n: p.result() for n, p in expected.items()},
            )

        checked = check()
        assert checked["tp0"].verified and checked["tp1"].verified, checked
        assert checked["tp0"].num_checked == checked["tp1"].num_checked == 4
        assert torch.equal(workers[1].receiver.model.w1, full.w1.detach()[:, 3:])
        # Placements known: the next sync checks each worker's slices before adopting them.
        staged = sender.sync(source.tensors(), version="v2", verify=True).verify
        assert staged["tp0"].verified and staged["tp1"].verified, staged
        assert staged["tp1"].num_checked == 4 and not staged["tp1"].pending
        with torch.no_grad():
            workers[1].receiver.model.w2.add_(1)
        checked = check()
        assert checked["tp0"].verified and not checked["tp1"].verified
        assert checked["tp1"].mismatched == ["worker 0: w2"]
    finally:
        sender.close()


def test_expected_prints_from_the_sent_fingerprints_alone_equal_those_from_the_elements():
    """`prints_from_sent` (every verified sync, every tensor: no per-tensor call) gives what
    `WorkerPrints` computes from the tensors' elements, for tensors of 1-, 2- and 4-byte dtypes
    placed whole at offsets of fused parameters and alone in their own; None as soon as one
    tensor is placed otherwise, or was not sent."""
    from weightsync.wire.placement import prints_from_sent
    from weightsync.wire.specs import TensorSpec

    gen = torch.Generator().manual_seed(0)
    tensors, placements = {}, {}
    for layer in range(3):
        # (name, dtype, shape, parameter, element offset in it)
        for part, dtype, shape, param, at in [
            ("q", torch.float32, (4, 8), "qkv", 0),
            ("k", torch.float32, (2, 8), "qkv", 32),
            ("v", torch.float32, (2, 8), "qkv", 48),
            ("gate", torch.bfloat16, (3, 8), "gate_up", 0),
            ("up", torch.bfloat16, (3, 8), "gate_up", 24),
            ("norm", torch.int8, (16,), "norm", 0),
        ]:
            name = f"l{layer}.{part}"
            tensor = torch.randn(shape, generator=gen) * 20
            tensors[name] = tensor.to(dtype)
            placements[name] = [f"l{layer}.{param}", [[at, 0, tensor.numel(), 1, 0, 0]]]
    specs = {
        n: TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
        for n, t in tensors.items()
    }
    sent = {n: list(fingerprint(t)) for n, t in tensors.items()}  # as plain data carries them
    got = prints_from_sent(placements, sent, specs)
    assert got is not None and len(got) == 3 * 3
    assert got == expected_worker_fingerprints(tensors, placements)
    sliced = {**placements, "l1.k": ["l1.qkv", [[32, 8, 8, 1, 0, 0]]]}
    assert prints_from_sent(sliced, sent, specs) is None
    del sent["l2.norm"]
    assert prints_from_sent(placements, sent, specs) is None
