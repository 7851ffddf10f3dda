"""The fused GPU copy kernel alone (weightsync/gpu/kernel.py), with and without its read-back,
against one device copy of the same bytes, over a real checkpoint layout's tensors.

    PYTHONPATH=$PWD python3 scripts/gpu_check_bench.py --layout qwen3-30b-a3b --layers 24

Sources are one tensor per checkpoint tensor, each at a 512-byte aligned offset of one buffer (as
the caching allocator places a trainer's parameters); destinations lie back to back in another
(as an engine's fused parameters). Per kernel configuration (`--chunks` bytes a program, `--blocks`
8-byte words a step, `--warps`): `Copies` (no read-back) and `CheckedCopies` (every word read back),
best of 5 by CUDA events, after one warm-up that compiles; memcpy = one `copy_` of all the bytes
between the two buffers. Prints a table (rich), or with `--json` the result as JSON. Every checked run must
report no differing tensor and leave the destinations equal to the sources.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from weightsync.apps import layouts
from weightsync.gpu import kernel


def _best_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available() or not kernel.available():
        raise SystemExit("needs a CUDA GPU and Triton")
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = layouts.layout(args.layout, num_layers=args.layers)
    sizes = [layouts.nbytes([item]) for item in shapes]
    src_at, dst_at, src_end, dst_end = [], [], 0, 0
    for nbytes in sizes:
        src_at.append(src_end)
        src_end += -(-nbytes // 512) * 512
        dst_at.append(dst_end)
        dst_end += nbytes
    src = torch.empty(src_end // 2, dtype=torch.int16, device=device).random_()
    dst = torch.zeros(dst_end // 2, dtype=torch.int16, device=device)
    src_bytes, dst_bytes = src.view(torch.uint8), dst.view(torch.uint8)
    pairs = [(dst_bytes[d : d + n], src_bytes[s : s + n]) for d, s, n in zip(dst_at, src_at, sizes)]
    odd = [i for i, (d, s) in enumerate(pairs) if not kernel.fusable(d, s)]
    if odd:
        raise SystemExit(f"{len(odd)} tensors the kernel cannot take (not 8-byte sized)")
    flat_src = src_bytes[:dst_end]
    result = {
        "layout": args.layout,
        "layers": args.layers,
        "tensors": len(shapes),
        "bytes": dst_end,
        "memcpy_ms": _best_ms(lambda: dst_bytes.copy_(flat_src)),
        "rows": [],
    }
    for chunk, block, warps in itertools.product(args.chunks, args.blocks, args.warps):
        kernel.CHUNK, kernel.BLOCK, kernel.WARPS = chunk, block, warps
        plain = kernel.Copies(pairs, device)
        checked = kernel.CheckedCopies(pairs, device)
        differing: list[int] = []
        copy_ms = _best_ms(plain.replay)
        dst.zero_()
        checked_ms = _best_ms(lambda run=checked.run, out=differing: out.extend(run()))
        if differing or not all(torch.equal(d, s) for d, s in pairs):
            raise RuntimeError(f"chunk {chunk}, block {block}, warps {warps}: copies differ")
        result["rows"].append(
            {
                "chunk": chunk,
                "block": block,
                "warps": warps,
                "copy_ms": copy_ms,
                "checked_ms": checked_ms,
                "copy_x_memcpy": copy_ms / result["memcpy_ms"],
                "checked_x_memcpy": checked_ms / result["memcpy_ms"],
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=layouts.LAYOUTS, default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="cut the layout (default all)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1 << 20, 1 << 18])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{result['layout']} ({result['tensors']} tensors, "
        f"{result['bytes'] / 1e9:.1f} GB): memcpy {result['memcpy_ms']:.2f} ms"
    )
    for column in ("chunk", "block", "warps", "copy ms (x memcpy)", "checked ms (x memcpy)"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(
            str(r["chunk"]),
            str(r["block"]),
            str(r["warps"]),
            f"{r['copy_ms']:.2f} ({r['copy_x_memcpy']:.3f})",
            f"{r['checked_ms']:.2f} ({r['checked_x_memcpy']:.3f})",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
