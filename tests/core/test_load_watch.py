"""scripts/load_watch.py as scripts/test.sh runs it: started in the background, stopped with
SIGTERM, it prints the machine first, the busiest samples with their processes and threads,
and the stolen and throttled CPU time last."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_watch_prints_the_machine_the_busiest_samples_and_the_stolen_time():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    watch = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "load_watch.py"), "--every", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3)
    finally:
        watch.send_signal(signal.SIGTERM)
        out, _ = watch.communicate(timeout=60)
        busy.kill()
    lines = out.splitlines()
    assert lines[0].startswith("== machine: ") and "CPUs, affinity [" in lines[0], out
    assert "cgroup CPU quota " in lines[0] and "/dev/shm " in lines[0], out
    assert any(line.startswith("== load_watch: ") and " samples " in line for line in lines), out
    # the spinning child is named among the busiest processes and threads
    assert any("while True: pass" in line for line in lines), out
    assert any(line.strip().startswith("busiest threads: python") for line in lines), out
    assert lines[-1].startswith("== load_watch: stolen "), out
    assert "cgroup throttling: " in lines[-1] and "CPU pressure: " in lines[-1], out
