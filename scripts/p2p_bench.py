"""The point-to-point transport's costs on this machine, for the scale simulator's link model
(weightsync/apps/scale.py): one trainer rank and one engine worker in two processes over gloo.

- per message: a sync of one 8-byte tensor (one message, the packing and the write included);
- per piece: a sync of --pieces tensors of 64 float32 elements each, less the per-message time,
  divided by the pieces (packing on the rank and the write on the worker);
- bandwidth: a sync of one tensor of --mb MiB.
Each is --repeats syncs back to back after a first one (which joins the group and makes the
views), timed on each side; a sync's time is the slower side's total over the repeats.

    .venv/bin/python scripts/p2p_bench.py [--pieces 20000] [--mb 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from weightsync.transports.p2p import PointToPointReceiver, PointToPointSender
from weightsync.wire.transfer_plan import TransferPlan, plan_transfers


def _plan(shapes: dict[str, int]) -> TransferPlan:
    return plan_transfers(
        {n: 4 for n in shapes},
        {n: [(0, 0, numel)] for n, numel in shapes.items()},
        [{n: [n, [[0, 0, numel, 1, 0, 0]]] for n, numel in shapes.items()}],
        num_ranks=1,
    )


def _cases(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    return {
        "message": {"t": 2},
        "pieces": {f"t{i}": 64 for i in range(args.pieces)},
        "bandwidth": {"t": args.mb * (1 << 20) // 4},
    }


def _sync(member: PointToPointSender | PointToPointReceiver, tensors: dict) -> None:
    if isinstance(member, PointToPointSender):
        member.send({n: (0, t) for n, t in tensors.items()})
    else:
        member.receive(tensors)


def _side(role: str, args: argparse.Namespace, ports: Any, results: Any) -> None:
    out = {}
    for case, shapes in _cases(args).items():
        plan = _plan(shapes)
        tensors = {n: torch.randn(numel) for n, numel in shapes.items()}
        member: PointToPointSender | PointToPointReceiver
        if role == "rank":
            member = PointToPointSender(plan, 0)
            ports.put(member.port)
        else:
            member = PointToPointReceiver(plan, 0, port=ports.get(timeout=120))
        _sync(member, tensors)  # joins the group, makes the views
        start = time.perf_counter()
        for _ in range(args.repeats):
            _sync(member, tensors)
        out[case] = (time.perf_counter() - start) / args.repeats
        member.close()
    results.put((role, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, default=20000)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_side, args=(r, args, ports, results)) for r in ("rank", "worker")]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    sync_s = {case: max(got["rank"][case], got["worker"][case]) for case in got["rank"]}
    message_s = sync_s["message"]
    print(
        json.dumps(
            {
                "message_us": round(message_s * 1e6, 1),
                "piece_us": round((sync_s["pieces"] - message_s) / args.pieces * 1e6, 2),
                "bandwidth_gb_s": round(args.mb * (1 << 20) / sync_s["bandwidth"] / 1e9, 2),
                "sender_s": got["rank"],
                "receiver_s": got["worker"],
                "pieces": args.pieces,
                "mb": args.mb,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
