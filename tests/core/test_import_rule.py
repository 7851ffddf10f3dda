"""The core never imports an engine: every core module imports with the engines made unimportable."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import weightsync


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
