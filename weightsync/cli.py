"""The `weightsync` command: environments (list, build, path, check), and the entry points.

Exit codes: 0 ok, 1 failure, 2 usage (an unknown env or command).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from itertools import combinations
from typing import Any

from weightsync.launch import abi, envs

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _names(args: argparse.Namespace) -> list[str]:
    names = list(envs.ENVS) if getattr(args, "all", False) else args.names
    if not names:
        raise envs.UnknownEnvError(f"name an env or pass --all; valid: {', '.join(envs.ENVS)}")
    for name in names:
        envs.get(name)
    return names


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for name, spec in envs.ENVS.items():
        pins = envs.pins(name)
        rows.append(
            [
                name,
                f"{spec.engine}=={pins.get(spec.engine, '?')}",
                pins.get("torch", "?"),
                pins.get("ray", "?"),
                pins["python"],
                envs.state(name),
                str(envs.python_path(name)),
            ]
        )
    print(_table(rows, ["env", "engine", "torch", "ray", "python", "state", "interpreter"]))
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for name in _names(args):
        print(f"== env {name}: {envs.state(name)}", flush=True)
        try:
            result = envs.build(name, quiet=args.quiet)
        except RuntimeError as exc:
            print(f"env {name}: build failed: {exc}", file=sys.stderr)
            status = EXIT_FAIL
            continue
        print(
            f"== env {name}: {result['action'] if result['action'] != 'none' else 'up to date'}"
            f" in {result['seconds']:.2f} s",
            flush=True,
        )
    return status


def cmd_path(args: argparse.Namespace) -> int:
    envs.get(args.name)
    print(envs.python_path(args.name))
    return EXIT_OK


def _pair_evidence(a: str, b: str) -> str:
    """Resolve two engine envs' engine pins together, in a scratch requirement set."""
    pa, pb = envs.pins(a), envs.pins(b)
    ea, eb = envs.get(a).engine, envs.get(b).engine
    reqs = f"{ea}=={pa[ea]}\n{eb}=={pb[eb]}\n"
    cmd = [*envs.uv_command(), "pip", "compile", "--python-version", "3.11", "--no-header", "-"]
    pinned = subprocess.run(cmd, input=reqs, capture_output=True, text=True, timeout=300)
    if pinned.returncode != 0:
        reason = next(
            (
                ln.strip()
                for ln in pinned.stderr.splitlines()
                if "Because" in ln or "unsatisfiable" in ln
            ),
            pinned.stderr.strip().splitlines()[-1:],
        )
        return f"cannot share: {ea}=={pa[ea]} + {eb}=={pb[eb]} unsatisfiable ({str(reason)[:160]})"
    loose = subprocess.run(cmd, input=f"{ea}\n{eb}\n", capture_output=True, text=True, timeout=300)
    got = {}
    for line in loose.stdout.splitlines():
        name, _, ver = line.partition("==")
        if name.strip() in (ea, eb):
            got[name.strip()] = ver.split()[0]
    downgraded = [
        f"{e} {got.get(e)} instead of {p[e]}" for e, p in ((ea, pa), (eb, pb)) if got.get(e) != p[e]
    ]
    if downgraded:
        return "cannot share: resolving both silently downgrades " + "; ".join(downgraded)
    return f"WARNING: {ea}=={pa[ea]} and {eb}=={pb[eb]} co-resolve"


def _abi_lines(reports: dict[str, abi.AbiReport], *, verbose: bool) -> list[str]:
    """The ABI table, then each missing torch symbol (demangled) beside the extension needing it."""
    rows = [
        [
            name,
            r.torch.version,
            str(len(r.extensions)),
            str(len(r.skipped)),
            str(r.num_torch_symbols),
            str(r.num_missing),
            f"{r.seconds:.1f}",
        ]
        for name, r in reports.items()
    ]
    lines = [
        _table(rows, ["env", "torch", "extensions", "skipped", "symbols", "missing", "seconds"])
    ]
    for name, report in reports.items():
        if verbose:
            lines += [
                f"  {name}: {e.path}: {e.num_torch_symbols} torch symbols"
                for e in report.extensions
            ]
            lines += [f"  {name}: {path}: skipped, {why}" for path, why in report.skipped.items()]
        for ext in report.broken:
            lines += [
                f"MISSING {name}: {ext.path} links {lib}, which torch {report.torch.version}"
                f" in {report.torch.site_packages} lacks"
                for lib in ext.missing_libraries
            ]
            lines += [
                f"MISSING {name}: {ext.path} needs {abi.demangle(symbol)}" for symbol in ext.missing
            ]
    return lines


def cmd_check_abi(args: argparse.Namespace) -> int:
    """What if: each named env's extensions against another env's (or folder's) torch."""
    names = _names(args)
    target = args.torch_from
    torch_site_packages = (
        envs.site_packages(target) if target in envs.ENVS else abi.site_packages_of(target)
    )
    reports = {
        name: abi.check(envs.site_packages(name), torch_site_packages=torch_site_packages)
        for name in names
    }
    print(f"compiled extensions against the torch in {torch_site_packages}:")
    print("\n".join(_abi_lines(reports, verbose=args.verbose)))
    return EXIT_OK if all(r.ok for r in reports.values()) else EXIT_FAIL


def cmd_check(args: argparse.Namespace) -> int:
    """The dependency-conflict matrix."""
    if args.torch_from:
        return cmd_check_abi(args)
    names = _names(args) if (args.names or args.all) else list(envs.ENVS)
    failed = False
    rows = []
    abi_reports = {}
    seen_py, seen_ray = {}, {}
    for name in names:
        start = time.perf_counter()
        lock_ok, lock_msg = envs.check_lock(name)
        if not lock_ok:
            failed = True
            rows.append([name, "STALE", "-", "-", "-", "-", lock_msg])
            continue
        try:
            envs.build(name, quiet=True)
        except RuntimeError as exc:
            failed = True
            rows.append([name, "current", "FAILED", "-", "-", "-", str(exc)])
            continue
        abi_reports[name] = abi.check(envs.site_packages(name))
        failed |= not abi_reports[name].ok
        info = envs.smoke(name)
        if "error" in info:
            failed = True
            rows.append([name, "current", "built", "-", "-", "-", info["error"]])
            continue
        seen_py[name], seen_ray[name] = info["python"], info["ray"]
        verdicts = []
        for mod, verdict in info["compiled"].items():
            if verdict == "needs GPU" and not envs.has_gpu():
                verdicts.append(f"{mod}: needs GPU to import (ABI checked below)")
            elif verdict != "ok":
                failed = True
                verdicts.append(f"{mod}: {verdict}")
            else:
                verdicts.append(f"{mod}: ok")
        rows.append(
            [
                name,
                "current",
                "built",
                f"{envs.get(name).engine} {info['engine']}",
                info["torch"],
                f"py {info['python']} / ray {info['ray']}",
                "; ".join(verdicts) + f" ({time.perf_counter() - start:.0f} s)",
            ]
        )
    print(_table(rows, ["env", "lock", "venv", "engine", "torch", "python/ray", "import check"]))
    for label, seen in (("python", seen_py), ("ray", seen_ray)):
        if len(set(seen.values())) > 1:
            failed = True
            print(
                f"MISMATCH: envs pin different {label}: "
                + ", ".join(f"{n}={v}" for n, v in seen.items())
            )
        elif seen:
            print(f"same {label} everywhere: {next(iter(seen.values()))}")
    if abi_reports:
        print(
            "\nABI: the torch symbols (count, missing) that each compiled extension needs, looked "
            "up in its env's torch/lib:"
        )
        print("\n".join(_abi_lines(abi_reports, verbose=args.verbose)))
    if not args.skip_pairs:
        print()
        pair_rows = []
        engine_envs = [n for n in names if n in envs.ENVS]
        for a, b in combinations(engine_envs, 2):
            if envs.get(a).engine_module == envs.get(b).engine_module:
                continue  # two builds of one engine are alternatives, not neighbours
            verdict = _pair_evidence(a, b)
            failed |= verdict.startswith("WARNING")
            pair_rows.append([f"{a} + {b}", verdict])
        print(_table(pair_rows, ["pair", "one shared environment?"]))
    return EXIT_FAIL if failed else EXIT_OK


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's help shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="weightsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="per-backend environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    env_sub.add_parser("list", help="each env: engine, torch, ray, python, state, path")
    p = env_sub.add_parser("build", help="uv sync --locked into envs/NAME/.venv")
    p.add_argument("names", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p = env_sub.add_parser("path", help="the env's python interpreter")
    p.add_argument("name")
    p = env_sub.add_parser("check", help="the dependency-conflict matrix")
    p.add_argument("names", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--skip-pairs", action="store_true", help="skip the pairwise resolution")
    p.add_argument(
        "--torch-from",
        metavar="ENV_OR_PATH",
        help="only the ABI check, against this env's torch (or a venv, site-packages "
        "or torch folder): which extensions would break on that torch",
    )
    p.add_argument(
        "--verbose", action="store_true", help="list every extension checked and every one skipped"
    )
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands() -> list:
    """Subcommands defined beside the code they run (demo, bench), added when present."""
    out = []
    for module in ("weightsync.apps.demo", "weightsync.apps.bench"):
        try:
            out.append(__import__(module, fromlist=["add_parser"]).add_parser)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    handlers = {"list": cmd_list, "build": cmd_build, "path": cmd_path, "check": cmd_check}
    try:
        if args.command == "env":
            return handlers[args.env_command](args)
        return args.run(args)
    except envs.UnknownEnvError as exc:
        print(f"weightsync: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, RuntimeError) as exc:
        print(f"weightsync: {exc}", file=sys.stderr)
        return EXIT_FAIL


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
