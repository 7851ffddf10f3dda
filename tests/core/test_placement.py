"""Placements: which elements of a trainer tensor a tensor-parallel worker's loader keeps, and
where, learned from the loader alone (weightsync/wire/placement.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync.wire.errors import VerificationFailed
from weightsync.wire.fingerprint import fingerprint
from weightsync.wire.placement import (
    expected_worker_fingerprints,
    learn_placement,
    learn_placements,
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


def _sliced_experts(experts: int, rank: int, transposed: frozenset = frozenset()):
    """Rank `rank` of 2 of an MoE layer: each expert's (8, 6) weight cut along dim 1 into one
    fused parameter [experts, 8, 3], in a shuffled order; the experts in `transposed` are
    kept transposed (a permutation, still a placement)."""
    param = _param((experts, 8, 3))
    slot = torch.randperm(experts, generator=torch.Generator().manual_seed(2)).tolist()

    def load_one(i, t):
        part = t.narrow(1, 3 * rank, 3)
        if i in transposed:
            part = t.t()[3 * rank : 3 * rank + 3].reshape(8, 3)
        param.data[slot[i]].copy_(part)

    return param, load_one


@pytest.mark.parametrize("rank", [0, 1])
def test_the_tensors_of_one_parameter_are_learned_together_as_each_alone(rank):
    """64 experts' slices in one fused parameter: learned together in two loads (one index
    pass: 3072 elements fit float32's 31 bits; one of random bytes), the same patterns as
    learned one at a time, and the live weights untouched."""
    experts = 64
    param, load_one = _sliced_experts(experts, rank, frozenset({5, 9}))
    live = param.data.clone()
    loads = []

    def load(pairs):
        loads.append(len(pairs))
        for i, t in pairs:
            load_one(i, t)

    items = [(torch.float32, (8, 6))] * experts
    together = learn_placements(param, items, load)
    alone = [
        learn_placement(param, torch.float32, (8, 6), lambda t, i=i: load_one(i, t))
        for i in range(experts)
    ]
    assert together == alone and all(together)
    assert loads == [experts, experts]  # one index pass (64 * 48 elements < 2**31), one random
    assert torch.equal(param.data, live)


def test_tensors_loaded_over_each_other_are_learned_one_at_a_time():
    """Two tensors the loader copies into the same place (a tied pair), in a parameter with a
    third: learned together they would give the first no elements; the random pass, loaded in
    reverse, catches it and each is learned alone: both placed at that place."""
    param = _param((3, 4))
    loads = []

    def load(pairs):
        loads.append([i for i, _ in pairs])
        for i, t in pairs:
            param.data[0 if i < 2 else 2].copy_(t)

    pats = learn_placements(param, [(torch.float32, (4,))] * 3, load)
    assert pats == [[[0, 0, 4, 1, 0, 0]], [[0, 0, 4, 1, 0, 0]], [[8, 0, 4, 1, 0, 0]]]
    assert loads[:2] == [[0, 1, 2], [2, 1, 0]] and len(loads) == 2 + 3 * 2


def test_a_tensor_of_another_dtype_or_empty_among_others_is_left_out_or_empty():
    param = _param((2, 4))

    def load(pairs):
        for i, t in pairs:
            if t.numel():
                param.data[i].copy_(t)

    pats = learn_placements(
        param, [(torch.float32, (4,)), (torch.bfloat16, (4,)), (torch.float32, (0,))], load
    )
    assert pats == [[[0, 0, 4, 1, 0, 0]], None, []]


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
    first sync, and the sender checks each against the trainer's elements it holds, before
    they adopt it: from the tensors read again (a list), or, given an iterator it cannot read
    again, not at all: that first sync is aborted, adopted by neither."""
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

    def connected() -> tuple[WeightSender, list[ModuleWeightReceiver]]:
        workers = [
            ModuleWeightReceiver(sliced_model(full, r, 2), name=f"w{r}", sliced=True)
            for r in range(2)
        ]
        sender = WeightSender(source.specs(), transport=ShmSender(), capacity_bytes=1 << 10)
        for r, worker in enumerate(workers):
            sender.add_engine(LocalEndpoint(worker, name=f"tp{r}"))
        return sender, workers

    once, held = connected()
    try:
        with pytest.raises(
            VerificationFailed,
            match=r"update 'v1' aborted before any engine adopted it: the workers of "
            r"\['tp0', 'tp1'\] hold slices .* `tensors` was read once \(generator\); pass a list",
        ):
            once.sync(source.tensors(), version="v1", verify=True)
        assert [w.weight_version() for w in held] == [None, None]
    finally:
        once.close()
    sender, workers = connected()
    try:
        first = sender.sync(list(source.tensors()), version="v1", verify=True).verify
        assert first["tp0"].verified and first["tp1"].verified, first
        assert first["tp1"].num_checked == 4 and not first["tp1"].pending

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
    from weightsync.wire.fingerprint import FingerprintBatch, table_prints
    from weightsync.wire.placement import WholePrints, prints_from_sent
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
    # The same by array arithmetic on the batch's table, the plan kept for the next sync.
    batch = FingerprintBatch()
    order = list(reversed(tensors))  # the table's rows in the order the tensors were sent
    batch.add_all([tensors[n] for n in order])
    table = batch.read_table()
    assert table_prints(table) == [fingerprint(tensors[n]) for n in order]
    plan = WholePrints.of(placements, order, specs)
    assert plan.whole and plan.prints(table) == got
    assert WholePrints.of(placements, list(order), specs) is plan
    sliced = {**placements, "l1.k": ["l1.qkv", [[32, 8, 8, 1, 0, 0]]]}
    assert prints_from_sent(sliced, sent, specs) is None
    assert not WholePrints.of(sliced, order, specs).whole
    del sent["l2.norm"]
    assert prints_from_sent(placements, sent, specs) is None
    assert not WholePrints.of(placements, order[1:], specs).whole  # l2.norm not sent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_placed_prints_equal_the_patterns_fingerprinted_one_by_one(dtype):
    """`placed_prints` (one zeroed span, one fingerprint) gives the combination of `placed` over
    the patterns, for a transposed slice (one pattern per row, copied as one block), column and
    row slices of a matrix, and runs longer than a fingerprint row; and equals the fingerprint
    of a parameter the patterns write (`_apply`) where they cover it."""
    from weightsync.wire.fingerprint import combine, placed
    from weightsync.wire.placement import blocks, placed_prints

    gen = torch.Generator().manual_seed(3)
    source = (torch.randn(96, 40, generator=gen) * 50).to(dtype)
    # The worker's parameter is rows 48..95 of the source transposed: dst (j, i) <- src (48+i, j).
    dst_idx = torch.arange(40 * 48)
    src_idx = (48 + dst_idx % 48) * 40 + dst_idx // 48
    transposed = patterns(dst_idx, src_idx)
    assert len(transposed) == 40 and len(blocks(transposed)) == 1
    long = torch.randint(-100, 100, (3, 70001), generator=gen).to(dtype)
    cases = [
        (source, transposed, (40, 48)),
        (source, [[0, 48 * 40, 48 * 40, 1, 0, 0]], (48, 40)),  # rows 48..95: one run
        (source, [[0, 20, 20, 96, 20, 40]], (96, 20)),  # columns 20..39 of each row
        (source, [[7, 20, 20, 96, 25, 40]], (96 * 25 + 7,)),  # the same at a stride, offset
        (long, [[5, 0, 70001, 3, 80000, 70001]], (3, 80000)),
        # Halves placed the other way round (a loader that swaps q and k): sources step back.
        (source, [[0, 1920, 1920, 1, 0, 0], [1920, 0, 1920, 1, 0, 0]], (96, 40)),
        (source, [[0, 40, 20, 1, 0, 0], [20, 0, 20, 1, 0, 0], [40, 60, 20, 1, 0, 0]], (3, 20)),
    ]
    for tensor, pats, shape in cases:
        flat = tensor.reshape(-1)
        want = combine([placed(pattern_view(flat, p), p[0], p[4]) for p in pats])
        assert placed_prints(flat, pats) == want, pats[:2]
        param = torch.zeros(shape, dtype=dtype)
        _apply(param, tensor, pats)
        assert placed_prints(flat, pats) == fingerprint(param)
    # A view into a larger storage (a bucket) gives the same.
    bucket = torch.cat([torch.zeros(13, dtype=dtype), source.reshape(-1)])
    assert placed_prints(bucket[13:], transposed) == placed_prints(source.reshape(-1), transposed)


def test_a_receiver_learns_whole_tensors_of_a_parameter_in_one_load_and_slices_by_element():
    """A receiver learning where a bucket's tensors land: 48 experts placed whole in one fused
    parameter take one load of them all (keyed random bytes), not a few loads each; a
    parameter that keeps a slice of its tensor is learned element by element; the placements
    are those learned one tensor at a time, and the live weights are untouched."""
    from weightsync.apps.layouts import build_module
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.specs import TensorSpec

    experts = 48
    model = build_module([("w13", (experts * 4, 6)), ("rows", (3, 6))], fill=True)
    where = {f"e{i}": ("w13", i * 24) for i in range(experts)}
    receiver = ModuleWeightReceiver(model, fused=where, sliced=True)
    params = dict(model.named_parameters())
    params["rows"].weight_loader = lambda p, t: p.data.copy_(t[3:])  # a worker's rows
    specs = [TensorSpec(name=n, dtype="bfloat16", shape=(4, 6)) for n in where]
    specs.append(TensorSpec(name="rows", dtype="bfloat16", shape=(6, 6)))
    receiver.check_refit([spec.to_dict() for spec in specs])
    live = {n: p.data.clone() for n, p in params.items()}
    loads = []
    inner = receiver.receiver.buckets.load
    receiver.receiver.buckets.load = lambda pairs: [loads.append(len(pairs)), inner(pairs)]
    tensors = [(s.name, torch.randn(s.shape).to(torch.bfloat16)) for s in specs]
    receiver.receiver.learn_placements(tensors)
    placements = receiver.receiver.placements
    assert placements == {n: ["w13", [[at, 0, 24, 1, 0, 0]]] for n, (_, at) in where.items()} | {
        "rows": ["rows", [[0, 18, 18, 1, 0, 0]]]
    }
    # The experts: one load; "rows": one of keyed bytes (its key is not where it landed), then
    # one index pass and one random pass.
    assert loads == [experts, 1, 1, 1], loads
    for name, p in params.items():
        assert torch.equal(p.data, live[name]), name


def test_a_receiver_guesses_many_parameters_in_one_load_and_a_later_bucket_from_where_they_end():
    """Three fused parameters whose tensors the loader copies back to back in bucket order are
    learned in one load of all their tensors on scratch memory; the next bucket's experts of
    the same parameter are guessed from where the first bucket's ended (one load again); a
    parameter whose loader reverses its tensors misses the guess and is placed by its own
    keyed load. The placements are the loaders', and the live weights are untouched."""
    from weightsync.apps.layouts import build_module
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.specs import TensorSpec

    shapes = [("a", (8, 6)), ("b", (12, 6)), ("w13", (16, 6)), ("rev", (8, 6))]
    where = {f"a{i}": ("a", i * 24) for i in range(2)}
    where |= {f"b{i}": ("b", i * 24) for i in range(3)}
    where |= {f"e{i}": ("w13", i * 24) for i in range(4)}
    where |= {f"r{i}": ("rev", (1 - i) * 24) for i in range(2)}  # in reverse
    model = build_module(shapes, fill=True)
    receiver = ModuleWeightReceiver(model, fused=where, sliced=True)
    specs = [TensorSpec(name=n, dtype="bfloat16", shape=(4, 6)) for n in where]
    receiver.check_refit([spec.to_dict() for spec in specs])
    params = dict(model.named_parameters())
    live = {n: p.data.clone() for n, p in params.items()}
    loads = []
    inner = receiver.receiver.buckets.load
    receiver.receiver.buckets.load = lambda pairs: [loads.append(len(pairs)), inner(pairs)]
    tensors = {s.name: torch.randn(s.shape).to(torch.bfloat16) for s in specs}
    first = ["a0", "a1", "b0", "b1", "b2", "e0", "e1", "r0", "r1"]
    receiver.receiver.learn_placements([(n, tensors[n]) for n in first])
    assert loads == [9, 2], loads  # one guess for all; "rev" alone, by keyed bytes
    loads.clear()
    receiver.receiver.learn_placements([(n, tensors[n]) for n in ("e2", "e3")])
    assert loads == [2], loads  # guessed from the end of e1
    placements = receiver.receiver.placements
    assert placements == {n: [p, [[at, 0, 24, 1, 0, 0]]] for n, (p, at) in where.items()}
    for name, p in params.items():
        assert torch.equal(p.data, live[name]), name
