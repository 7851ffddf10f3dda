"""Time a staged update's switch (weightsync/engine/staging.py `StagedWeights.switch`) on one
model of a checkpoint layout, in this process: the copy of what the update wrote into the served
parameters (today's switch, inside the engine's pause), beside the swapping switch that
`keep_previous` makes (the served parameters and the copy swapped, so a revert can put the
previous weights back: two more copies of the same bytes and a scratch tensor), and a device
copy of the same bytes (of at most 4 GB, its rate scaled). No engine: this is the switch's own copy work, the pause's floor; an
engine's pause adds its hold, cache reset and version tag (docs/staged.md).

    .venv/bin/python scripts/switch_bench.py --layout llama8b --shrink 8
    python scripts/switch_bench.py --device cuda --layout llama8b            # one GPU
    python scripts/switch_bench.py --device cuda --layout qwen3-30b-a3b --layers 24

It also times the first switch, which makes the batched copies, and where the tree has
`StagedWeights.prepare` (an engine's stage makes them there, before its pause) the first switch
after it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

from weightsync.apps.layouts import LAYOUTS, build_module, layout, nbytes
from weightsync.engine.staging import StagedWeights


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS, default="llama8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--shrink", type=int, default=1)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = layout(
        args.layout, num_layers=args.layers, shrink=args.shrink, num_experts=args.experts
    )
    model = build_module(shapes, device=str(device), fill=True)
    staging = StagedWeights(model)
    staging.refresh()
    names = {name for name, _ in model.named_parameters()}

    # The first switch makes its batched copies (on a GPU one address lookup per tensor);
    # `prepare` (an engine's stage, before its pause) makes them ahead where the tree has it.
    first = _timed(lambda: staging.switch(names), device, 1)[0]
    prepared = None
    if hasattr(StagedWeights, "prepare"):
        staging._plans.clear()  # as before the first switch
        prepare_s = _timed(lambda: staging.prepare(names), device, 1)[0]
        prepared = (prepare_s, _timed(lambda: staging.switch(names), device, 1)[0])
    copy = _timed(lambda: staging.switch(names), device, args.repeats)
    if "packed" in inspect.signature(StagedWeights.switch).parameters:
        swap = _timed(lambda: staging.switch(names, swap=True), device, args.repeats)
    else:  # a tree from before the batched switch (`--before`): `swap` was the read function

        def read(name: str, into: torch.Tensor, param: torch.Tensor) -> None:
            into.copy_(param)

        swap = _timed(lambda: staging.switch(names, swap=read), device, args.repeats)
    # A device copy of at most 4 GB, its rate scaled to the model's bytes (it fills memory).
    size = min(nbytes(shapes), 4 << 30)
    flat = torch.ones(size, dtype=torch.uint8, device=device)
    other = torch.empty_like(flat)
    plain = [
        t * nbytes(shapes) / size for t in _timed(lambda: other.copy_(flat), device, args.repeats)
    ]
    result = {
        "layout": args.layout,
        "tensors": len(shapes),
        "bytes": nbytes(shapes),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "switch_s": min(copy),
        "swap_switch_s": min(swap),
        "device_copy_s": min(plain),
        "first_switch_s": first,
        "prepare_s": prepared[0] if prepared else None,
        "first_switch_after_prepare_s": prepared[1] if prepared else None,
        "switch_each_s": copy,
        "swap_switch_each_s": swap,
    }
    print(json.dumps(result))
    print(
        f"{args.layout}: {len(shapes)} tensors, {nbytes(shapes) / 1e9:.2f} GB on {result['device']}"
        f": switch {min(copy) * 1e3:.1f} ms, swapping switch {min(swap) * 1e3:.1f} ms "
        f"({min(swap) / min(copy):.2f}x), one device copy of the bytes {min(plain) * 1e3:.1f} ms"
        f" (best of {args.repeats}); the first switch {first * 1e3:.1f} ms"
        + (
            f", after prepare ({prepared[0] * 1e3:.1f} ms, outside the pause) "
            f"{prepared[1] * 1e3:.1f} ms"
            if prepared
            else ""
        )
    )


if __name__ == "__main__":
    main()
