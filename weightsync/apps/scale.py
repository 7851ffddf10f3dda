"""Simulated syncs past one machine: the transfer planner fed real models and 256-2048 GPUs.

`weightsync scale` runs the planner of the point-to-point path (weightsync/wire/transfer_plan.py)
on a real model's layout (weightsync/apps/layouts.py), a trainer's sharding and the engines'
topology, and predicts a sync's time with a link model. Nothing is allocated: only names,
shapes and element counts.

- Trainer: `gpus` ranks in `hsdp` groups (each FSDP2-sharding every tensor along dim 0 over its
  ranks, `fsdp_holdings`); with `ep` > 1, experts are split among `ep` expert-parallel ranks
  (rank r has expert index r % ep, as a (fsdp, ep) device mesh gives) and FSDP-sharded over the
  ranks of their index.
- Engines: `replicas` replicas of `tp` workers each, holding what vLLM's tensor parallelism
  gives a worker (rows of column-parallel tensors: q/k/v, gate/up, q_b/kv_b, embeddings and the
  head; columns of row-parallel ones: o and down; norms, routers, MLA's q_a/kv_a whole); with
  `engine_ep`, each worker holds whole experts, a contiguous range of them; with
  `attention_dp` (data-parallel attention beside expert parallelism), every other tensor whole.
  The real path learns these placements from the engines' loaders instead.
- Links: each GPU has its own NIC of `nic_gbps`, used at `efficiency`; every link (a rank and a
  worker that exchange bytes) costs `message_us` once a sync at each end, every piece (a run of
  one tensor) `piece_us` at each end. An endpoint's time is the sum of its three terms; the
  sync's, the slowest endpoint's (sends and receives overlap, nothing else is modelled).

The planner is run once per kind of tensor (same shape, same placement, same holders: an MoE's
experts are a few kinds), weighted by how many the model has, and on gcd(replicas, hsdp)
replicas, whose ranks' totals are scaled to all replicas (replicas are alike; only the choice
among HSDP holders differs between them). Where hsdp does not divide replicas, a kind's weighted
block goes to one holder and the busiest rank can be off by ~15%; the per-rank figures are then
refused rather than shown (plan with `exact` instead).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from weightsync.apps import layouts
from weightsync.wire.transfer_plan import Holding, Pattern, fsdp_holdings, plan_transfers

_ROWS = re.compile(r"(embed_tokens|lm_head|[qkv]_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.")
_COLUMNS = re.compile(r"(o_proj|down_proj)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(kw_only=True, slots=True)
class Trainer:
    gpus: int
    hsdp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.gpus % self.hsdp or (self.gpus // self.hsdp) % self.ep:
            raise ValueError(
                f"trainer gpus={self.gpus}: must be a multiple of hsdp={self.hsdp} times "
                f"ep={self.ep}"
            )


@dataclass(kw_only=True, slots=True)
class Engines:
    tp: int
    replicas: int
    engine_ep: bool = False
    attention_dp: bool = False


@dataclass(kw_only=True, slots=True)
class Links:
    nic_gbps: float = 400.0
    efficiency: float = 0.85
    message_us: float = 20.0
    piece_us: float = 2.2
    element_bytes: int = 2

    @property
    def bytes_per_s(self) -> float:
        return self.nic_gbps / 8 * 1e9 * self.efficiency


def _kind(name: str, shape: tuple[int, ...], tp: int) -> str:
    """How a TP worker holds the tensor: "rows", "columns" or "whole"."""
    if len(shape) == 2 and _ROWS.search(name) and shape[0] % tp == 0:
        return "rows"
    if len(shape) == 2 and _COLUMNS.search(name) and shape[1] % tp == 0:
        return "columns"
    return "whole"


def _patterns(kind: str, shape: tuple[int, ...], tp: int, worker: int) -> list[Pattern]:
    numel = math.prod(shape)
    if kind == "rows":
        part = numel // tp
        return [[0, worker * part, part, 1, 0, 0]]
    if kind == "columns":
        rows, cols = shape
        width = cols // tp
        return [[0, worker * width, width, rows, width, cols]]
    return [[0, 0, numel, 1, 0, 0]]


def _holders(trainer: Trainer, expert_index: int | None) -> list[list[int]]:
    """The ranks, in mesh order, over which each HSDP group shards a tensor."""
    per_group = trainer.gpus // trainer.hsdp
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(trainer.hsdp)]
    if expert_index is None:
        return groups
    return [[r for r in group if r % trainer.ep == expert_index] for group in groups]


def plan_inputs(
    shapes: layouts.Layout,
    trainer: Trainer,
    engines: Engines,
    *,
    simulated_replicas: int,
    exact: bool = False,
) -> tuple[dict[str, int], dict[str, list[Holding]], list[dict[str, Any]], dict[str, int]]:
    """(element bytes, holdings, workers' placements, weights) of one tensor of each kind
    (with `exact`, of every tensor)."""
    num_experts = 1 + max(
        (int(m.group(1)) for n, _ in shapes if (m := _EXPERT.search(n))), default=-1
    )
    if trainer.ep > 1 and num_experts % trainer.ep:
        raise ValueError(f"trainer ep={trainer.ep} does not divide {num_experts} experts")
    if engines.engine_ep and num_experts % engines.tp:
        raise ValueError(f"engine tp={engines.tp} does not divide {num_experts} experts")
    weights: dict[str, int] = {}
    holdings: dict[str, list[Holding]] = {}
    workers: list[dict[str, Any]] = [{} for _ in range(simulated_replicas * engines.tp)]
    for name, shape in shapes:
        match = _EXPERT.search(name)
        expert = int(match.group(1)) if match else None
        kind = "whole" if engines.attention_dp else _kind(name, shape, engines.tp)
        owner = None  # the engine worker of an expert under engine EP
        if expert is not None and engines.engine_ep:
            kind, owner = "whole", expert // (num_experts // engines.tp)
        ep_index = None
        if expert is not None and trainer.ep > 1:
            ep_index = expert // (num_experts // trainer.ep)
        key = name if exact else f"{kind}:{shape}:owner={owner}:ep={ep_index}"
        if key in weights:
            weights[key] += 1
            continue
        weights[key] = 1
        holdings[key] = [
            h for group in _holders(trainer, ep_index) for h in fsdp_holdings(shape, group)
        ]
        for replica in range(simulated_replicas):
            for w in range(engines.tp):
                if owner is None or owner == w:
                    workers[replica * engines.tp + w][key] = [
                        key,
                        _patterns(kind, shape, engines.tp, w),
                    ]
    return {k: 1 for k in weights}, holdings, workers, weights


def simulate(
    model: str,
    trainer: Trainer,
    engines: Engines,
    links: Links,
    *,
    num_layers: int | None = None,
    shrink: int = 1,
    exact: bool = False,
) -> dict[str, Any]:
    """One configuration: the plan's totals and the predicted time (module docstring). With
    `exact`, every tensor and every replica is planned (slow past a few hundred GPUs)."""
    shapes = layouts.layout(model, num_layers=num_layers, shrink=shrink)
    if not exact and engines.replicas % trainer.hsdp:
        raise ValueError(
            f"replicas={engines.replicas} with hsdp={trainer.hsdp}: the shortcut plans whole "
            "kinds of tensors per holder, which is exact only when hsdp divides the replicas; "
            "choose such counts or plan exactly (simulate(..., exact=True))"
        )
    simulated = engines.replicas if exact else math.gcd(engines.replicas, trainer.hsdp)
    sizes, holdings, workers, weights = plan_inputs(
        shapes, trainer, engines, simulated_replicas=simulated, exact=exact
    )
    plan = plan_transfers(sizes, holdings, workers, num_ranks=trainer.gpus, weights=weights)
    s = plan.summary()
    scale = engines.replicas // simulated
    eb = links.element_bytes
    rank_bytes = [b * eb * scale for b in s["rank_bytes"]]
    rank_pieces = [p * scale for p in s["rank_pieces"]]
    rank_links = [n * scale for n in s["rank_links"]]
    worker_bytes = [b * eb for b in s["worker_bytes"]]
    bw = links.bytes_per_s

    def endpoint(nbytes: int, pieces: int, num_links: int) -> dict[str, float]:
        return {
            "bytes_s": nbytes / bw,
            "pieces_s": pieces * links.piece_us * 1e-6,
            "messages_s": num_links * links.message_us * 1e-6,
        }

    ranks = [endpoint(*t) for t in zip(rank_bytes, rank_pieces, rank_links)]
    workers_t = [endpoint(*t) for t in zip(worker_bytes, s["worker_pieces"], s["worker_links"])]
    slowest_rank = max(ranks, key=lambda t: sum(t.values()))
    slowest_worker = max(workers_t, key=lambda t: sum(t.values()))
    slowest, side = max(
        ((slowest_rank, "trainer rank"), (slowest_worker, "engine worker")),
        key=lambda x: sum(x[0].values()),
    )
    model_bytes = layouts.nbytes(shapes, eb)
    return {
        "model": model,
        "trainer": asdict(trainer),
        "engines": asdict(engines),
        "links": asdict(links),
        "num_tensors": len(shapes),
        "model_gb": model_bytes / 1e9,
        "moved_gb": sum(rank_bytes) / 1e9,
        "max_rank_gb": max(rank_bytes) / 1e9,
        "mean_rank_gb": sum(rank_bytes) / len(rank_bytes) / 1e9,
        "max_worker_gb": max(worker_bytes) / 1e9,
        "max_rank_links": max(rank_links),
        "max_rank_pieces": max(rank_pieces),
        "max_worker_pieces": max(s["worker_pieces"]),
        "rank0_gb": rank_bytes[0] / 1e9,
        "predicted_s": sum(slowest.values()),
        "bottleneck": f"{side}: " + max(slowest, key=lambda k: slowest[k]).removesuffix("_s"),
        # Today's path for comparison: every byte gathered to rank 0, then sent once from it
        # (a broadcast's pipelined rate at best): twice the model through one NIC.
        "through_rank0_s": 2 * model_bytes / bw,
        "plans": {"tensor_kinds": len(weights), "simulated_replicas": simulated},
    }


def _configs(args: argparse.Namespace) -> list[tuple[Trainer, Engines]]:
    out = []
    for entry in args.gpus:
        if "+" in entry:
            train, infer = (int(x) for x in entry.split("+"))
        else:
            train = int(entry) * args.train_share // 100
            infer = int(entry) - train
        replicas = infer // args.tp
        if replicas < 1:
            raise ValueError(f"--gpus {entry}: no engine replica of tp={args.tp} fits")
        out.append(
            (
                Trainer(gpus=train, hsdp=args.hsdp, ep=args.ep),
                Engines(
                    tp=args.tp,
                    replicas=replicas,
                    engine_ep=args.engine_ep,
                    attention_dp=args.attention_dp,
                ),
            )
        )
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scale", help="simulate point-to-point syncs of a real model's layout at 256-2048 GPUs"
    )
    p.add_argument(
        "--model", default="deepseek-v3", choices=[n for n in layouts.LAYOUTS if n != "uniform"]
    )
    p.add_argument(
        "--gpus",
        type=lambda v: v.split(","),
        default=["256", "512", "1024", "2048"],
        help="comma-separated: N (--train-share of N train) or TRAIN+INFER",
    )
    p.add_argument("--train-share", type=int, default=50, help="percent of --gpus that train")
    p.add_argument("--hsdp", type=int, default=1, help="trainer replica groups")
    p.add_argument("--ep", type=int, default=1, help="trainer expert-parallel size")
    p.add_argument("--tp", type=int, default=8, help="engine workers per replica")
    p.add_argument("--engine-ep", action="store_true", help="engine workers hold whole experts")
    p.add_argument(
        "--attention-dp",
        action="store_true",
        help="engine workers hold every tensor but the experts whole (with --engine-ep)",
    )
    p.add_argument("--nic-gbps", type=float, default=400.0)
    p.add_argument("--efficiency", type=float, default=0.85)
    p.add_argument("--message-us", type=float, default=20.0)
    p.add_argument("--piece-us", type=float, default=2.2)
    p.add_argument("--element-bytes", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (for docs)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    links = Links(
        nic_gbps=args.nic_gbps,
        efficiency=args.efficiency,
        message_us=args.message_us,
        piece_us=args.piece_us,
        element_bytes=args.element_bytes,
    )
    rows = [simulate(args.model, t, e, links) for t, e in _configs(args)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    header = [
        "train GPUs",
        "engines",
        "moved GB",
        "max rank GB",
        "max worker GB",
        "max rank links",
        "max rank pieces",
        "predicted s",
        "bottleneck",
        "via rank 0 s",
    ]
    cells = [_cells(r) for r in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + " --- |" * len(header))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model}: point-to-point sync, predicted")
    for h in header:
        table.add_column(h, justify="right")
    for c in cells:
        table.add_row(*c)
    Console(width=200).print(table)
    return 0


def _cells(r: dict[str, Any]) -> list[str]:
    t, e = r["trainer"], r["engines"]
    return [
        f"{t['gpus']} (hsdp {t['hsdp']}, ep {t['ep']})",
        f"{e['replicas']} x {e['tp']}"
        + (" ep" if e["engine_ep"] else " tp")
        + (" dp-attn" if e["attention_dp"] else ""),
        f"{r['moved_gb']:.0f}",
        f"{r['max_rank_gb']:.2f}",
        f"{r['max_worker_gb']:.1f}",
        str(r["max_rank_links"]),
        str(r["max_rank_pieces"]),
        f"{r['predicted_s']:.2f}",
        r["bottleneck"],
        f"{r['through_rank0_s']:.1f}",
    ]
