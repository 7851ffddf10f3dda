"""The import rules that keep the layout a map of the architecture.

weightsync/ is foldered by where code runs: gpu/ (device kernels that know no protocol) at the
bottom, wire/ (the contract both sides import) on it, transports/ above them, trainer/ and engine/ side by side (they never import each
other: a trainer rank and an engine worker share only the wire), driver/ for the driver, apps/
on top. Only backends/ imports an engine, and the command line starts without torch.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import weightsync

PACKAGE = Path(weightsync.__file__).resolve().parent

# folder (or top-level module) -> the weightsync folders its code may import, lazily or not
ALLOWED: dict[str, set[str]] = {
    "gpu": set(),
    "wire": {"gpu"},
    "transports": {"wire", "gpu"},
    "trainer": {"wire", "gpu", "transports"},
    "engine": {"wire", "gpu", "transports"},
    "driver": {"wire", "transports"},
    "apps": {"wire", "gpu", "transports", "trainer", "engine", "driver", "<api>"},
    "cli": {"driver", "apps", "<api>"},
    "__main__": {"cli"},
    "__init__": {"wire", "gpu", "transports", "trainer", "engine", "driver"},
}


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_rooms(path: Path) -> list[tuple[int, str]]:
    """(line, weightsync folder) for every import of weightsync code in the file, including
    imports inside functions ("<api>": the lazy public API, `from weightsync import X`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = node.module.split(".")
            if names[0] != "weightsync":
                continue
            if len(names) > 1:
                found.append((node.lineno, names[1]))
            else:  # `from weightsync import x`: a folder, or a name of the public API
                for alias in node.names:
                    is_folder = (PACKAGE / alias.name).is_dir()
                    found.append((node.lineno, alias.name if is_folder else "<api>"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "weightsync":
                    found.append((node.lineno, names[1] if len(names) > 1 else "<api>"))
    return found


def test_each_folder_imports_only_the_folders_below_it():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = _room(path)
        if room == "backends":  # a wheel's copy of the top-level backends/
            continue
        allowed = ALLOWED.get(room)
        assert allowed is not None, f"{path}: folder {room!r} has no import rule; add one"
        for line, target in _imported_rooms(path):
            if target != room and target not in allowed:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not broken, "imports against the layout:\n" + "\n".join(broken)


def test_trainer_and_engine_never_import_each_other():
    for side, other in (("trainer", "engine"), ("engine", "trainer")):
        for path in sorted((PACKAGE / side).rglob("*.py")):
            hits = [line for line, target in _imported_rooms(path) if target == other]
            assert not hits, f"{path}:{hits[0]}: {side}/ imports {other}/"


def test_the_rule_sees_imports_inside_functions(tmp_path):
    # The checker must catch a lazy import, the usual way a rule is broken quietly.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from weightsync.engine.replica import ModelReceiver\n")
    assert _imported_rooms(probe) == [(2, "engine")]


def test_every_core_module_imports_without_engines():
    modules = ["weightsync"] + [
        m.name
        for m in pkgutil.walk_packages(weightsync.__path__, prefix="weightsync.")
        if not m.name.endswith("__main__")  # running it is the CLI, not an import
    ]
    assert len(modules) > 8
    code = (
        "import sys\n"
        "for banned in ('sglang', 'vllm', 'sgl_kernel'):\n"
        "    sys.modules[banned] = None\n"
        "import importlib\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "leaked = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm', 'sgl_kernel')"
        " and sys.modules[m] is not None]\n"
        "assert not leaked, leaked\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_the_cli_and_the_driver_modules_import_without_torch():
    driver = [m.name for m in pkgutil.iter_modules([str(PACKAGE / "driver")], "weightsync.driver.")]
    assert "weightsync.driver.launcher" in driver
    code = (
        "import importlib, sys\n"
        f"for name in ['weightsync.cli', *{driver!r}]:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} pulled in torch'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_public_api_resolves_and_the_package_imports_without_torch():
    code = (
        "import sys\n"
        "import weightsync, weightsync.cli\n"
        "assert 'torch' not in sys.modules, 'import weightsync pulled in torch'\n"
        "names = list(weightsync.__all__)\n"
        "missing = [n for n in names if getattr(weightsync, n, None) is None]\n"
        "assert not missing, missing\n"
        "print('ok', len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", str(len(weightsync.__all__))]


def test_the_public_functions_stay_functions_once_every_module_is_imported():
    # A folder named like a public function (weightsync.launch) would replace it on the package
    # as soon as anything imported the folder.
    code = (
        "import importlib, pkgutil, weightsync\n"
        "for m in pkgutil.walk_packages(weightsync.__path__, prefix='weightsync.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "import types\n"
        "shadowed = [n for n in weightsync.__all__\n"
        "            if isinstance(getattr(weightsync, n), types.ModuleType)]\n"
        "assert not shadowed, shadowed\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
