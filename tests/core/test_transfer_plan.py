"""The transfer plan (weightsync/wire/transfer_plan.py): FSDP2-sharded trainer ranks send each
engine worker the elements its placements keep, each element once, from a rank that holds it.
Placements here are learned by the project's own learner from loaders that slice as
tensor-parallel engines do; the plan is then run on real tensors, rank by rank, each rank
reading only its own shard."""

from __future__ import annotations

import json
import random

import pytest
import torch

from weightsync.wire.placement import learn_placement, pattern_view
from weightsync.wire.transfer_plan import (
    PlanCache,
    TransferPlan,
    clip,
    fsdp_holdings,
    plan_transfers,
)

SHAPES = {
    "embed": (10, 6),  # rows split (vocab-parallel)
    "qkv": (12, 6),  # q, k, v fused: each worker keeps a head range of each
    "o": (6, 8),  # columns split (row-parallel)
    "norm": (6,),  # replicated
    "bias": (3,),  # fewer rows than ranks
}


def _elements(pattern: list[int]) -> dict[int, int]:
    """{source element: destination element} of a pattern, one run at a time."""
    dst, src, length, count, dst_stride, src_stride = pattern
    return {
        src + i * src_stride + k: dst + i * dst_stride + k
        for i in range(count)
        for k in range(length)
    }


def test_clip_keeps_exactly_the_elements_of_a_pattern_inside_the_range():
    rng = random.Random(0)
    for _ in range(3000):
        length = rng.randint(1, 5)
        count = rng.randint(1, 6)
        src_stride = rng.randint(length, length + 4) if count > 1 else 0
        dst_stride = rng.randint(length, length + 3) if count > 1 else 0
        pattern = [rng.randint(0, 9), rng.randint(0, 9), length, count, dst_stride, src_stride]
        start = rng.randint(0, 40)
        stop = rng.randint(start, 45)
        pieces = clip(pattern, start, stop)
        assert len(pieces) <= 3
        want = {s: d for s, d in _elements(pattern).items() if start <= s < stop}
        got: dict[int, int] = {}
        for piece in pieces:
            for s, d in _elements(piece).items():
                assert s not in got, (pattern, start, stop, pieces)
                got[s] = d
        assert got == want, (pattern, start, stop, pieces)


@pytest.mark.parametrize("ranks", [1, 3, 4, 7])
@pytest.mark.parametrize("shape", [(10, 6), (3,), (8, 2, 3), (0, 4)])
def test_fsdp_holdings_are_torch_chunk_along_dim_0(shape, ranks):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    chunks = full.chunk(ranks, dim=0) if shape[0] else ()
    want = []
    start = 0
    for rank, chunk in enumerate(chunks):
        if chunk.numel():
            want.append((rank, start, start + chunk.numel()))
        start += chunk.numel()
    assert fsdp_holdings(shape, ranks) == want


def _learned(tp: int) -> list[dict]:
    """Each TP worker's placements, learned from loaders that narrow as a TP engine does."""

    def loader(name: str, rank: int):
        def load(param: torch.Tensor, tensor: torch.Tensor) -> None:
            if name == "embed":
                rows = tensor.shape[0] // tp
                param.copy_(tensor[rank * rows : (rank + 1) * rows])
            elif name == "qkv":
                part = tensor.shape[0] // 3 // tp  # rows of one of q, k, v on this worker
                pieces = [tensor[j * tp * part + rank * part :][:part] for j in range(3)]
                param.copy_(torch.cat(pieces))
            elif name == "o":
                cols = tensor.shape[1] // tp
                param.copy_(tensor[:, rank * cols : (rank + 1) * cols])
            else:
                param.copy_(tensor)

        return load

    workers = []
    for rank in range(tp):
        placed = {}
        for name, shape in SHAPES.items():
            local = list(shape)
            if name in ("embed", "qkv"):
                local[0] //= tp
            elif name == "o":
                local[1] //= tp
            param = torch.nn.Parameter(torch.zeros(local), requires_grad=False)
            load = loader(name, rank)
            pats = learn_placement(
                param, torch.float32, shape, lambda t, load=load, param=param: load(param.data, t)
            )
            assert pats is not None, name
            placed[name] = [name, pats]
        workers.append(placed)
    return workers


def _run(plan: TransferPlan, full: dict[str, torch.Tensor], holdings: dict, workers: list):
    """Each rank sends only from its own shards (what it holds, as `fsdp_holdings` says); each
    worker writes what it receives into zeroed parameters and counts the writes per element."""
    params = [{n: torch.zeros(full[n].numel()) for n in placed} for placed in workers]
    writes = [{n: torch.zeros(full[n].numel()) for n in placed} for placed in workers]
    for rank in range(plan.num_ranks):
        shards = {
            n: (start, full[n].reshape(-1)[start:stop])
            for n, held in holdings.items()
            for r, start, stop in held
            if r == rank
        }
        for worker, moves in plan.sends(rank).items():
            for name, *pattern in moves:
                start, shard = shards[name]  # KeyError: a rank sending what it does not hold
                local = [pattern[0], pattern[1] - start, *pattern[2:]]
                assert local[1] >= 0 and local[1] + (local[3] - 1) * local[5] + local[2] <= (
                    shard.numel()
                ), (rank, name, pattern)
                pattern_view(params[worker][name], local, dst=True).copy_(
                    pattern_view(shard, local)
                )
                pattern_view(writes[worker][name], local, dst=True).add_(1)
    return params, writes


def _expected(full: dict[str, torch.Tensor], placed: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, (_, pats) in placed.items():
        param = torch.zeros(full[name].numel())
        flat = full[name].reshape(-1)
        for p in pats:
            pattern_view(param, p, dst=True).copy_(pattern_view(flat, p))
        out[name] = param
    return out


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 5])
def test_each_worker_gets_each_kept_element_once_from_a_rank_that_holds_it(num_ranks):
    """Two replicas of a TP=2 engine (four workers) from FSDP2 ranks: rows, columns, a fused
    qkv's head ranges, replicated norms, a tensor of fewer rows than ranks."""
    workers = _learned(2) * 2
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    holdings = {n: fsdp_holdings(s, num_ranks) for n, s in SHAPES.items()}
    plan = plan_transfers({n: 4 for n in SHAPES}, holdings, workers, num_ranks=num_ranks)
    params, writes = _run(plan, full, holdings, workers)
    for w, placed in enumerate(workers):
        want = _expected(full, placed)
        for name, (_, pats) in placed.items():
            assert torch.equal(params[w][name], want[name]), (w, name)
            kept = torch.zeros(full[name].numel())
            for p in pats:
                pattern_view(kept, p, dst=True).fill_(1)
            assert torch.equal(writes[w][name], kept), (w, name)  # each kept element once
    summary = plan.summary()
    kept_bytes = sum(
        4 * sum(p[2] * p[3] for p in pats) for ws in workers for _, pats in ws.values()
    )
    assert summary["total_bytes"] == kept_bytes  # nothing sent twice, nothing sent not kept
    # Every rank holds something of each worker's slices here, and sends it.
    assert all(b > 0 for b in summary["rank_bytes"])


def test_replicated_holdings_are_spread_so_no_rank_sends_much_more_than_its_share():
    """HSDP: two groups of four ranks hold the same shards (rank r and rank r + 4); eight
    workers (four replicas of a TP=2 engine) need everything. The two holders of each shard
    share its sends: each sends half of what one group alone would, within one move."""
    shapes = {f"layer{i}.{n}": s for i in range(4) for n, s in SHAPES.items()}
    holdings = {
        n: fsdp_holdings(s, [0, 1, 2, 3]) + fsdp_holdings(s, [4, 5, 6, 7])
        for n, s in shapes.items()
    }
    workers = [{f"layer{i}.{n}": p for i in range(4) for n, p in w.items()} for w in _learned(2)]
    sizes = {n: 2 for n in shapes}
    plan = plan_transfers(sizes, holdings, workers * 4, num_ranks=8)
    alone = plan_transfers(
        sizes, {n: fsdp_holdings(s, 4) for n, s in shapes.items()}, workers * 4, num_ranks=4
    )
    rank_bytes = plan.summary()["rank_bytes"]
    largest = max(plan.move_bytes(m) for moves in plan.moves.values() for m in moves)
    for r, one_group in enumerate(alone.summary()["rank_bytes"]):
        assert rank_bytes[r] + rank_bytes[r + 4] == one_group
        assert abs(rank_bytes[r] - rank_bytes[r + 4]) <= largest, (r, rank_bytes)


def test_elements_no_rank_holds_are_refused_naming_the_tensor():
    workers = _learned(2)
    holdings = {n: fsdp_holdings(s, 2) for n, s in SHAPES.items()}
    holdings["o"] = [h for h in holdings["o"] if h[0] != 1]  # rank 1's half of "o" is missing
    with pytest.raises(ValueError, match="tensor 'o': worker 0 keeps"):
        plan_transfers({n: 4 for n in SHAPES}, holdings, workers, num_ranks=2)


def test_a_tensor_a_worker_keeps_that_the_trainer_does_not_send_is_refused():
    workers = _learned(2)
    holdings = {n: fsdp_holdings(s, 2) for n, s in SHAPES.items()}
    sizes = {n: 4 for n in SHAPES if n != "norm"}
    with pytest.raises(
        ValueError, match=r"worker 0 keeps tensors the trainer does not send: \['norm'\]"
    ):
        plan_transfers(sizes, holdings, workers, num_ranks=2)


def test_a_plan_is_plain_data_that_crosses_as_json():
    workers = _learned(2)
    holdings = {n: fsdp_holdings(s, 3) for n, s in SHAPES.items()}
    plan = plan_transfers({n: 4 for n in SHAPES}, holdings, workers, num_ranks=3)
    again = TransferPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_a_plan_is_made_once_per_pair_of_layouts_and_again_when_either_changes():
    cache = PlanCache()
    workers = _learned(2)
    made = []

    def make(ranks: int, placed: list) -> TransferPlan:
        made.append(ranks)
        holdings = {n: fsdp_holdings(s, ranks) for n, s in SHAPES.items()}
        return plan_transfers({n: 4 for n in SHAPES}, holdings, placed, num_ranks=ranks)

    first = cache.get(("fsdp", 2), (2,), lambda: make(2, workers))
    assert cache.get(("fsdp", 2), (2,), lambda: make(2, workers)) is first
    assert cache.get(("fsdp", 4), (2,), lambda: make(4, workers)).num_ranks == 4  # trainer
    cache.get(("fsdp", 4), (2, 2), lambda: make(4, workers * 2))  # a second engine joined
    assert made == [2, 4, 4] and cache.num_planned == 3
