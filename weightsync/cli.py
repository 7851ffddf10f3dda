"""The `weightsync` command: environments (list, build, path, check), and the entry points.

Exit codes: 0 ok, 1 failure, 2 usage (an unknown env, group or command).
Tables are plain text, never cut to the terminal's width (so they read the same piped);
`env list --json` and `env check --json` print one JSON object on stdout instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from itertools import combinations
from typing import Any, TextIO

from weightsync import __version__
from weightsync.driver import abi, envs

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


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=1)
    print()


def cmd_list(args: argparse.Namespace) -> int:
    listed: dict[str, dict[str, Any]] = {}
    for name, spec in envs.ENVS.items():
        pins = envs.pins(name)
        listed[name] = {
            "engine": spec.engine,
            "engine_version": pins.get(spec.engine),
            "torch": pins.get("torch"),
            "ray": pins.get("ray"),
            "python": pins["python"],
            "state": envs.state(name),
            "groups": list(envs.built_groups(name)),
            "available_groups": list(envs.available_groups(name)),
            "interpreter": str(envs.python_path(name)),
        }
    if args.json:
        _print_json({"envs": listed})
        return EXIT_OK
    rows = [
        [
            name,
            f"{e['engine']}=={e['engine_version'] or '?'}",
            e["torch"] or "?",
            e["ray"] or "?",
            e["python"],
            e["state"],
            ",".join(e["groups"]) or "-",
            e["interpreter"],
        ]
        for name, e in listed.items()
    ]
    header = ["env", "engine", "torch", "ray", "python", "state", "groups", "interpreter"]
    print(_table(rows, header))
    return EXIT_OK


def _groups(value: str) -> list[str]:
    return [g.strip() for g in value.split(",") if g.strip()]


def cmd_build(args: argparse.Namespace) -> int:
    names = _names(args)
    for name in names:  # an unknown group or an unsupported driver refuses before any build
        envs.check_groups(name, args.groups)
        envs.check_host(name)
    status = EXIT_OK
    for name in names:
        print(f"== env {name}: {_described_state(name)}", flush=True)
        try:
            result = envs.build(name, groups=args.groups, quiet=args.quiet)
        except RuntimeError as exc:
            print(f"env {name}: build failed: {exc}", file=sys.stderr)
            status = EXIT_FAIL
            continue
        print(f"== env {name}: {_described_build(result)}", flush=True)
    return status


def _described_state(name: str) -> str:
    groups = envs.built_groups(name) if envs.state(name) in ("built", "stale") else ()
    return envs.state(name) + (f" (groups: {', '.join(groups)})" if groups else "")


def _described_build(result: dict[str, Any]) -> str:
    action = "up to date" if result["action"] == "none" else result["action"]
    groups = f" (groups: {', '.join(result['groups'])})" if result["groups"] else ""
    return f"{action} in {result['seconds']:.2f} s{groups}"


def cmd_path(args: argparse.Namespace) -> int:
    envs.get(args.name)
    print(envs.python_path(args.name))
    return EXIT_OK


def _pair_evidence(a: str, b: str) -> str:
    """Resolve two engine envs' engine pins together, in a scratch requirement set, for the
    driver's Python (the one the envs follow)."""
    pa, pb = envs.pins(a), envs.pins(b)
    ea, eb = envs.get(a).engine, envs.get(b).engine
    reqs = f"{ea}=={pa[ea]}\n{eb}=={pb[eb]}\n"
    python = envs.host_pair().python
    cmd = [*envs.uv_command(), "pip", "compile", "--python-version", python, "--no-header", "-"]
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
    ok = all(r.ok for r in reports.values())
    if args.json:
        _print_json(
            {
                "ok": ok,
                "torch_site_packages": str(torch_site_packages),
                "abi": {name: r.to_dict() for name, r in reports.items()},
            }
        )
    else:
        print(f"compiled extensions against the torch in {torch_site_packages}:")
        print("\n".join(_abi_lines(reports, verbose=args.verbose)))
    return EXIT_OK if ok else EXIT_FAIL


def _build_for_check(name: str, progress: TextIO) -> None:
    """Build the env if it needs it, with a line before and after (the build takes minutes)."""
    before = envs.state(name)
    if before == "built":
        return
    print(f"== env {name}: {before}; building", file=progress, flush=True)
    result = envs.build(name, quiet=True)
    print(f"== env {name}: {_described_build(result)}", file=progress, flush=True)


_NEEDS_GPU = "needs GPU to import (ABI checked below)"


def _check_env(name: str, progress: TextIO) -> tuple[dict[str, Any], abi.AbiReport | None]:
    """One env's lock, build, import check and ABI check, as plain data (and the ABI report)."""
    start = time.perf_counter()
    checked: dict[str, Any] = {"ok": False, "engine": envs.get(name).engine}
    lock_ok, lock_msg = envs.check_lock(name)
    checked["lock"] = "current" if lock_ok else "stale"
    if not lock_ok:
        return {**checked, "venv": "-", "error": lock_msg}, None
    try:
        _build_for_check(name, progress)
    except RuntimeError as exc:
        return {**checked, "venv": "failed", "error": str(exc)}, None
    checked["venv"] = "built"
    report = abi.check(envs.site_packages(name))
    info = envs.smoke(name)
    if "error" in info:
        return {**checked, "error": info["error"]}, report
    compiled = {
        mod: _NEEDS_GPU if verdict == "needs GPU" and not envs.has_gpu() else verdict
        for mod, verdict in info["compiled"].items()
    }
    checked |= {
        "ok": report.ok and all(v in ("ok", _NEEDS_GPU) for v in compiled.values()),
        "engine_version": info["engine"],
        "torch": info["torch"],
        "python": info["python"],
        "ray": info["ray"],
        "compiled": compiled,
        "seconds": time.perf_counter() - start,
    }
    return checked, report


def cmd_check(args: argparse.Namespace) -> int:
    """The dependency-conflict matrix."""
    if args.torch_from:
        return cmd_check_abi(args)
    names = _names(args) if (args.names or args.all) else list(envs.ENVS)
    progress = sys.stderr if args.json else sys.stdout
    checked: dict[str, dict[str, Any]] = {}
    abi_reports: dict[str, abi.AbiReport] = {}
    for name in names:
        checked[name], report = _check_env(name, progress)
        if report is not None:
            abi_reports[name] = report
    failed = not all(c["ok"] for c in checked.values())
    same: dict[str, str | None] = {}
    mismatches = []
    for label in ("python", "ray"):
        seen = {n: c[label] for n, c in checked.items() if label in c}
        same[label] = next(iter(seen.values())) if len(set(seen.values())) == 1 else None
        if len(set(seen.values())) > 1:
            mismatches.append(
                f"MISMATCH: envs pin different {label}: "
                + ", ".join(f"{n}={v}" for n, v in seen.items())
            )
    failed |= bool(mismatches)
    pairs: list[dict[str, Any]] = []
    if not args.skip_pairs:
        engine_envs = [n for n in names if n in envs.ENVS]
        for a, b in combinations(engine_envs, 2):
            if envs.get(a).engine_module == envs.get(b).engine_module:
                continue  # two builds of one engine are alternatives, not neighbours
            verdict = _pair_evidence(a, b)
            pairs.append(
                {"envs": [a, b], "can_share": verdict.startswith("WARNING"), "evidence": verdict}
            )
    failed |= any(p["can_share"] for p in pairs)
    if args.json:
        _print_json(
            {
                "ok": not failed,
                "envs": checked,
                "same_python": same["python"],
                "same_ray": same["ray"],
                "mismatches": mismatches,
                "abi": {name: r.to_dict() for name, r in abi_reports.items()},
                "pairs": pairs,
            }
        )
        return EXIT_FAIL if failed else EXIT_OK
    rows = []
    for name, c in checked.items():
        if "compiled" not in c:
            lock = "STALE" if c["lock"] == "stale" else "current"
            rows.append(
                [
                    name,
                    lock,
                    c["venv"].upper() if c["venv"] == "failed" else c["venv"],
                    "-",
                    "-",
                    "-",
                    c["error"],
                ]
            )
            continue
        verdicts = "; ".join(f"{mod}: {v}" for mod, v in c["compiled"].items())
        rows.append(
            [
                name,
                "current",
                "built",
                f"{c['engine']} {c['engine_version']}",
                c["torch"],
                f"py {c['python']} / ray {c['ray']}",
                f"{verdicts} ({c['seconds']:.0f} s)",
            ]
        )
    print(_table(rows, ["env", "lock", "venv", "engine", "torch", "python/ray", "import check"]))
    for line in mismatches:
        print(line)
    for label in ("python", "ray"):
        if same[label]:
            print(f"same {label} everywhere: {same[label]}")
    if abi_reports:
        print(
            "\nABI: the torch symbols (count, missing) that each compiled extension needs, looked "
            "up in its env's torch/lib:"
        )
        print("\n".join(_abi_lines(abi_reports, verbose=args.verbose)))
    if not args.skip_pairs:
        print()
        pair_rows = [[" + ".join(p["envs"]), p["evidence"]] for p in pairs]
        print(_table(pair_rows, ["pair", "one shared environment?"]))
    return EXIT_FAIL if failed else EXIT_OK


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's help shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="weightsync", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="per-backend environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    p = env_sub.add_parser("list", help="each env: engine, torch, ray, python, state, groups, path")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = env_sub.add_parser("build", help="uv sync --locked into envs/NAME/.venv")
    p.add_argument("names", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--with",
        dest="groups",
        metavar="GROUP[,GROUP]",
        type=_groups,
        action="extend",
        default=[],
        help="dependency groups to install besides the runtime set: trainer (nemo-automodel), "
        "test (pytest); installed groups stay until the venv is removed",
    )
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
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (build progress goes to stderr)",
    )
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands() -> list:
    """Subcommands defined beside the code they run (demo, bench, scale), added when present."""
    out = []
    for module in ("weightsync.apps.demo", "weightsync.apps.bench", "weightsync.apps.scale"):
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
    except (envs.UnknownEnvError, envs.UnknownGroupError, envs.UnsupportedHostError) as exc:
        print(f"weightsync: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, RuntimeError) as exc:
        print(f"weightsync: {exc}", file=sys.stderr)
        return EXIT_FAIL


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
