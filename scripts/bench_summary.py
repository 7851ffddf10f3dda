"""Print one line per path from scripts/cpu_layout_bench.py --json output files:
sync s, memcpy s, ratio, verified sync s and what verification adds.

    python scripts/bench_summary.py out/*.json
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            out = json.load(f)
        for name, p in out["paths"].items():
            sync, memcpy, verified = p["sync_s"], p["memcpy_s"], p["verified_sync_s"]
            print(
                f"{path}: {name}: sync {sync:.4f} s, memcpy {memcpy:.4f} s, "
                f"ratio {memcpy / sync:.2f}, verified {verified:.4f} s "
                f"({(verified / sync - 1) * 100:+.0f}%)"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
