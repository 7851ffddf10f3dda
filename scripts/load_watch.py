"""What the machine was busy with while the test suites ran: samples every `--every` seconds
(the load, the memory available, each process's share of a core since the last sample) until
it is sent SIGTERM or SIGINT, then prints the busiest samples with their busiest processes.

    python scripts/load_watch.py --every 10 &   # scripts/test.sh starts and stops it

A slow test whose cause is another process (one left spinning by an earlier suite, or a
niceness that starves an engine) shows up here by name, niceness and command line; each sample
also names the busiest threads (a spinning waiter shows up there beside the thread that works).
First it prints the machine (CPU model and the vector units the engines' CPU kernels use, cores
and this process's affinity, a cgroup CPU quota, /dev/shm), last the CPU time stolen by the
host, a cgroup's throttling and the kernel's CPU pressure over the run."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(slots=True)
class Sample:
    at: str
    load1: float
    avail_mib: int
    busiest: list[tuple[float, int, int, str]]  # (% of a core, pid, nice, command line)
    threads: list[tuple[str, float]]  # (thread name/process name, % of a core)


class _Stop(Exception):
    """SIGTERM or SIGINT: stop sampling and report."""


def _command(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()).strip()[:110] or proc.name()
    except (psutil.Error, OSError):
        return "?"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _cgroup_cpu() -> str:
    """This process's cgroup directory for the CPU controller (v1's cpu, else v2's)."""
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return f"/sys/fs/cgroup/cpu{path}".rstrip("/")
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            return f"/sys/fs/cgroup{line[3:]}".rstrip("/")
    return "/sys/fs/cgroup"


def _cpu_quota() -> str:
    """The cgroup's CPU quota in CPUs, v2 (cpu.max) or v1 (cfs_quota_us / cfs_period_us)."""
    where = _cgroup_cpu()
    v2 = _read(f"{where}/cpu.max").split()
    if len(v2) == 2:
        return "none" if v2[0] == "max" else f"{int(v2[0]) / int(v2[1]):.2f} CPUs"
    quota = _read(f"{where}/cpu.cfs_quota_us")
    period = _read(f"{where}/cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return f"{int(quota) / int(period):.2f} CPUs"
    return "none"


def _throttled() -> str:
    stat = _read(f"{_cgroup_cpu()}/cpu.stat")
    fields = dict(line.split() for line in stat.splitlines() if len(line.split()) == 2)
    return ", ".join(
        f"{k} {fields[k]}"
        for k in ("nr_throttled", "throttled_usec", "throttled_time")
        if k in fields
    )


def machine() -> str:
    """One line: what the machine is."""
    cpu: dict[str, str] = {}  # the first CPU's fields
    for line in _read("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        cpu.setdefault(key.strip(), value.strip())
    model = cpu.get("model name") or platform.processor()
    flags = set(cpu.get("flags", "").split())
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    shm = shutil.disk_usage("/dev/shm").total >> 20 if os.path.isdir("/dev/shm") else 0
    return (
        f"== machine: {model}; {' '.join(units) or 'no avx2'}; {os.cpu_count()} CPUs, "
        f"affinity {sorted(os.sched_getaffinity(0))}; cgroup CPU quota {_cpu_quota()}; "
        f"/dev/shm {shm} MiB; kernel {platform.release()}"
    )


class Threads:
    """Each thread's CPU time between two samples, by thread name/process name."""

    def __init__(self) -> None:
        self.ticks: dict[str, int] = {}
        self.hz = os.sysconf("SC_CLK_TCK")
        self.at = time.monotonic()

    def busiest(self) -> list[tuple[str, float]]:
        now, ticks, shares = time.monotonic(), {}, []
        for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            try:
                text = stat.read_text()
                owner = Path(f"/proc/{stat.parts[2]}/comm").read_text().strip()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2 :].split()
            used = int(fields[11]) + int(fields[12])  # utime + stime
            key = str(stat.parent)
            ticks[key] = used
            if key in self.ticks:
                share = 100.0 * (used - self.ticks[key]) / self.hz / max(now - self.at, 1e-3)
                shares.append((f"{text[text.find('(') + 1 : text.rfind(')')]}/{owner}", share))
        self.ticks, self.at = ticks, now
        return sorted(shares, key=lambda x: -x[1])[:4]


def sample(procs: dict[int, psutil.Process], threads: Threads) -> Sample:
    seen: list[tuple[float, int, int, str]] = []
    for proc in psutil.process_iter():
        known = procs.get(proc.pid)
        if known is None or not known.is_running():  # new, or its pid taken by another
            known = procs[proc.pid] = proc
        try:
            share = known.cpu_percent(None)
            nice = known.nice()
        except (psutil.Error, OSError):
            continue
        if share >= 5.0:
            seen.append((share, known.pid, nice, _command(known)))
    seen.sort(reverse=True)
    return Sample(
        at=time.strftime("%H:%M:%S"),
        load1=os.getloadavg()[0],
        avail_mib=psutil.virtual_memory().available >> 20,
        busiest=seen[:4],
        threads=threads.busiest(),
    )


def report(samples: list[Sample], top: int) -> None:
    if not samples:
        return
    least = min(s.avail_mib for s in samples)
    print(
        f"== load_watch: {len(samples)} samples {samples[0].at}-{samples[-1].at}; "
        f"load1 max {max(s.load1 for s in samples):.1f}; memory available min {least} MiB"
    )
    busiest = sorted(samples, key=lambda s: sum(b[0] for b in s.busiest), reverse=True)[:top]
    for s in sorted(busiest, key=lambda s: s.at):
        print(f"{s.at} load1 {s.load1:.1f} avail {s.avail_mib} MiB")
        for share, pid, nice, command in s.busiest:
            print(f"    {share:5.0f}% pid {pid} nice {nice:2d} {command}")
        print("    busiest threads: " + ", ".join(f"{n} {c:.0f}%" for n, c in s.threads))


def counters() -> tuple[float, str]:
    """(CPU seconds stolen by the host so far, the kernel's CPU pressure line)."""
    steal = getattr(psutil.cpu_times(), "steal", 0.0)
    return steal, _read("/proc/pressure/cpu").splitlines()[0] if _read("/proc/pressure/cpu") else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--top", type=int, default=8, help="busiest samples to print")
    args = parser.parse_args()

    def on_signal(*_: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs: dict[int, psutil.Process] = {}
    samples: list[Sample] = []
    print(machine(), flush=True)
    steal_before, _ = counters()
    started = time.monotonic()
    try:
        threads = Threads()
        sample(procs, threads)  # each process's first share is measured from here
        while True:
            time.sleep(args.every)
            samples.append(sample(procs, threads))
            procs = {pid: p for pid, p in procs.items() if psutil.pid_exists(pid)}
    except _Stop:
        pass
    report(samples, args.top)
    steal, pressure = counters()
    print(
        f"== load_watch: stolen {steal - steal_before:.0f} CPU s of {time.monotonic() - started:.0f} s; "
        f"cgroup throttling: {_throttled() or 'none'}; CPU pressure: {pressure or '?'}"
    )


if __name__ == "__main__":
    main()
