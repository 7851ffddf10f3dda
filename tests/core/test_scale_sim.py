"""The scale simulator (weightsync/apps/scale.py): the planner run once per kind of tensor and
on a few replicas, weighted, gives the totals the planner gives when run on every tensor and
every replica; and the totals obey what a plan must (every worker's share moved once, nothing
from a rank beyond its holdings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from weightsync.apps import layouts
from weightsync.apps.scale import Engines, Links, Trainer, simulate

TOTALS = (
    "moved_gb",
    "max_rank_gb",
    "mean_rank_gb",
    "max_worker_gb",
    "max_rank_links",
    "max_rank_pieces",
    "max_worker_pieces",
    "rank0_gb",
    "predicted_s",
)


@pytest.mark.parametrize(
    ("model", "trainer", "engines"),
    [
        ("qwen3-30b-a3b", Trainer(gpus=8), Engines(tp=2, replicas=3)),
        ("qwen3-30b-a3b", Trainer(gpus=8, ep=4), Engines(tp=4, replicas=2, engine_ep=True)),
        ("deepseek-v3", Trainer(gpus=12, ep=2), Engines(tp=2, replicas=2)),
        (
            "deepseek-v3",
            Trainer(gpus=8),
            Engines(tp=4, replicas=2, engine_ep=True, attention_dp=True),
        ),
        ("llama70b", Trainer(gpus=6), Engines(tp=2, replicas=2)),
    ],
    ids=["moe-fsdp", "moe-ep-both-sides", "mla-moe-ep", "mla-moe-dp-attention", "dense"],
)
def test_planning_each_kind_of_tensor_once_gives_the_totals_of_planning_every_tensor(
    model, trainer, engines
):
    kwargs = {"num_layers": 4, "shrink": 64}
    fast = simulate(model, trainer, engines, Links(), **kwargs)
    exact = simulate(model, trainer, engines, Links(), exact=True, **kwargs)
    assert fast["plans"]["tensor_kinds"] < exact["plans"]["tensor_kinds"]
    for key in TOTALS:
        assert fast[key] == pytest.approx(exact[key], rel=1e-9), key


def test_replicas_planned_as_a_few_give_the_totals_of_planning_them_all_under_hsdp():
    """With HSDP the replicas differ in which holder sends; planned as gcd(replicas, hsdp) of
    them the bytes and pieces are the same and the busiest rank within a few percent."""
    args = ("qwen3-30b-a3b", Trainer(gpus=8, hsdp=2), Engines(tp=2, replicas=4), Links())
    fast = simulate(*args, num_layers=4, shrink=64)
    exact = simulate(*args, num_layers=4, shrink=64, exact=True)
    assert fast["plans"]["simulated_replicas"] == 2 and exact["plans"]["simulated_replicas"] == 4
    for key in ("moved_gb", "mean_rank_gb", "max_worker_gb", "max_worker_pieces"):
        assert fast[key] == pytest.approx(exact[key], rel=1e-9), key
    assert fast["max_rank_gb"] == pytest.approx(exact["max_rank_gb"], rel=0.05)


def test_every_worker_receives_its_share_once_and_the_bytes_leave_the_ranks_that_hold_them():
    model = "deepseek-v3"
    shapes = layouts.layout(model, num_layers=5, shrink=32)
    engines = Engines(tp=4, replicas=3)
    r = simulate(model, Trainer(gpus=16), engines, Links(), num_layers=5, shrink=32)
    model_gb = layouts.nbytes(shapes) / 1e9
    assert r["model_gb"] == pytest.approx(model_gb)
    # Rows and columns are split four ways, the rest is whole on every worker: a worker gets
    # at least a quarter of the model, every replica a whole model or more.
    assert r["max_worker_gb"] >= model_gb / 4
    assert r["moved_gb"] == pytest.approx(r["mean_rank_gb"] * 16)
    assert r["moved_gb"] >= engines.replicas * model_gb
    # No rank, rank 0 included, sends more than the replicas times what FSDP gives it.
    assert r["max_rank_gb"] <= engines.replicas * r["max_worker_gb"] * 4 / 16 * 1.5


def test_the_cli_prints_a_row_per_gpu_count():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightsync",
            "scale",
            "--model",
            "llama70b",
            "--gpus",
            "32,48+16",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["trainer"]["gpus"], r["engines"]["replicas"]) for r in rows] == [(16, 2), (48, 2)]
    assert all(r["predicted_s"] > 0 and r["bottleneck"] for r in rows)


def test_counts_the_shortcut_cannot_plan_exactly_are_refused():
    with pytest.raises(ValueError, match="replicas=3 with hsdp=2"):
        simulate("llama70b", Trainer(gpus=8, hsdp=2), Engines(tp=2, replicas=3), Links())
