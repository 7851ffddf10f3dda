"""Would the dynamic linker find every torch symbol an env's compiled extensions need?

The failure this answers is "undefined symbol: _ZN3c10..." when an engine's kernels meet a torch
they were not built against. Importing them needs the hardware they were built for (sgl_kernel
loads libcuda at import), so the answer here comes from the ELF files alone and runs anywhere:
each extension in the env that links a torch library (DT_NEEDED) has its strong undefined dynamic
symbols that are torch's (C++ names under c10::, at::, torch::, caffe2::; the C names aoti_torch_*,
torch_*, THP*) looked up in the exports of the torch libraries it links, directly or through one
another. Weak undefined symbols are skipped: the linker lets them stay unresolved.

pyelftools reads the files; each symbol table is unpacked in one pass because pyelftools'
per-symbol parsing took 2.5 s for libtorch_cpu.so's ~76,000 symbols alone. A whole env (440-710
shared objects scanned, 6-35 extensions checked) then takes 1-2 s of CPU on the 2-core machine."""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from collections.abc import Container
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import cxxfilt  # libstdc++'s __cxa_demangle through ctypes: no binutils needed
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

logger = logging.getLogger(__name__)

TORCH_NAMESPACES = frozenset({"c10", "at", "torch", "caffe2"})
TORCH_C_PREFIXES = ("aoti_torch_", "torch_", "THP")

_SHN_UNDEF = 0
_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE = 1, 2, 10
# A special name's prefix (vtable, typeinfo, thunk, guard variable); the entity it belongs to
# follows. Call offsets are h<n>_ or v<n>_<n>_, a leading n marking a negative number.
_SPECIAL = re.compile(r"T[VTISHW]|G[VR]|Thn?\d+_|Tvn?\d+_n?\d+_|Tc(?:hn?\d+_|vn?\d+_n?\d+_){2}")
_PYTHON_TAG = re.compile(r"\.cpython-(\d+)-")
_TORCH_TAG = re.compile(r"torch(\d)(\d+)")


@dataclass(kw_only=True, frozen=True, slots=True)
class ElfSymbols:
    """The dynamic linking facts of one ELF file."""

    needed: tuple[str, ...]
    exported: frozenset[str]
    undefined: frozenset[str]
    """Strong undefined symbols only: a weak one may stay unresolved."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Torch:
    """One torch installation's libraries (torch/lib) and what each exports."""

    site_packages: Path
    version: str
    libraries: dict[str, ElfSymbols]

    def scope(self, needed: tuple[str, ...]) -> list[str]:
        """The torch libraries a file with these DT_NEEDED entries loads, breadth-first."""
        order = [name for name in needed if name in self.libraries]
        for name in order:
            order += [
                dep
                for dep in self.libraries[name].needed
                if dep in self.libraries and dep not in order
            ]
        return order


@dataclass(kw_only=True, frozen=True, slots=True)
class ExtensionResult:
    path: str
    """Relative to site-packages."""
    num_torch_symbols: int
    missing: tuple[str, ...]
    """Mangled torch symbols that none of the torch libraries it loads exports."""
    missing_libraries: tuple[str, ...]
    """Torch libraries in its DT_NEEDED that the torch checked against does not have."""


@dataclass(kw_only=True, slots=True)
class AbiReport:
    """One env's extensions checked against one torch."""

    site_packages: Path
    torch: Torch
    extensions: list[ExtensionResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Extension path -> why it is never loaded next to this torch, so was not checked."""
    seconds: float = 0.0

    @property
    def num_torch_symbols(self) -> int:
        return sum(e.num_torch_symbols for e in self.extensions)

    @property
    def num_missing(self) -> int:
        return sum(len(e.missing) for e in self.extensions)

    @property
    def broken(self) -> list[ExtensionResult]:
        return [e for e in self.extensions if e.missing or e.missing_libraries]

    @property
    def ok(self) -> bool:
        return not self.broken

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `weightsync env check --json`: missing symbols mangled and demangled."""
        return {
            "ok": self.ok,
            "site_packages": str(self.site_packages),
            "torch_version": self.torch.version,
            "torch_site_packages": str(self.torch.site_packages),
            "num_torch_symbols": self.num_torch_symbols,
            "num_missing": self.num_missing,
            "seconds": self.seconds,
            "extensions": [
                {
                    "path": e.path,
                    "num_torch_symbols": e.num_torch_symbols,
                    "missing": [{"symbol": m, "demangled": demangle(m)} for m in e.missing],
                    "missing_libraries": list(e.missing_libraries),
                }
                for e in self.extensions
            ],
            "skipped": dict(self.skipped),
        }

    def summary(self) -> str:
        line = (
            f"{len(self.extensions)} extensions, {self.num_torch_symbols - self.num_missing}/"
            f"{self.num_torch_symbols} torch symbols resolved by torch {self.torch.version}"
        )
        if self.num_missing:
            line += f"; {self.num_missing} MISSING"
        num_libraries = sum(len(e.missing_libraries) for e in self.extensions)
        if num_libraries:
            line += f"; {num_libraries} torch libraries MISSING"
        return line


def read_elf(path: Path, *, only_if_needs: Container[str] | None = None) -> ElfSymbols | None:
    """DT_NEEDED, exported and strong undefined dynamic symbols. None for a file that is not ELF,
    or, given only_if_needs, one whose DT_NEEDED names none of those libraries."""
    with open(path, "rb") as stream:
        if stream.read(4) != b"\x7fELF":
            return None
        stream.seek(0)
        elf = ELFFile(stream)
        dynamic = elf.get_section_by_name(".dynamic")
        needed: tuple[str, ...] = ()
        if isinstance(dynamic, DynamicSection):
            needed = tuple(
                tag.needed  # type: ignore[attr-defined]  # pyelftools sets it per DT_NEEDED tag
                for tag in dynamic.iter_tags()
                if tag.entry.d_tag == "DT_NEEDED"
            )
        if only_if_needs is not None and not any(name in only_if_needs for name in needed):
            return None
        exported: set[str] = set()
        undefined: set[str] = set()
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is not None:
            _split_symbols(elf, dynsym, exported, undefined)
    return ElfSymbols(needed=needed, exported=frozenset(exported), undefined=frozenset(undefined))


def _split_symbols(elf: ELFFile, dynsym, exported: set[str], undefined: set[str]) -> None:
    order = "<" if elf.little_endian else ">"
    if elf.elfclass == 64:  # st_name, st_info, st_other, st_shndx, st_value, st_size
        layout, name_at, info_at, shndx_at = order + "IBBHQQ", 0, 1, 3
    else:  # st_name, st_value, st_size, st_info, st_other, st_shndx
        layout, name_at, info_at, shndx_at = order + "IIIBBH", 0, 3, 5
    strtab = elf.get_section(dynsym["sh_link"]).data()
    for entry in struct.iter_unpack(layout, dynsym.data()):
        start = entry[name_at]
        if not start:
            continue
        bind, shndx = entry[info_at] >> 4, entry[shndx_at]
        name = strtab[start : strtab.index(b"\0", start)].decode()
        if shndx == _SHN_UNDEF:
            if bind == _STB_GLOBAL:
                undefined.add(name)
        elif bind in (_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE):
            exported.add(name)


def is_torch_symbol(name: str) -> bool:
    """Does this (mangled) symbol name belong to torch's C++ namespaces or its C API?"""
    if not name.startswith("_Z"):
        return name.startswith(TORCH_C_PREFIXES)
    rest = name[2:]
    while True:  # the entity a vtable, typeinfo, thunk or local name belongs to
        special = _SPECIAL.match(rest)
        if special:
            rest = rest[special.end() :]
        elif rest.startswith(("Z", "L")):
            rest = rest[1:]
        else:
            break
    if rest.startswith("N"):
        rest = rest[1:].lstrip("rVKRO")
    length = re.match(r"\d+", rest)
    if not length:
        return False  # std::, a substitution, an operator at global scope
    first = rest[length.end() : length.end() + int(length.group())]
    return first in TORCH_NAMESPACES or first.startswith("THP")


def demangle(name: str) -> str:
    """The C++ spelling of a mangled name; C names and names it cannot parse come back as is."""
    try:
        return cxxfilt.demangle(name)
    except cxxfilt.Error:
        return name


def site_packages_of(target: str | os.PathLike[str]) -> Path:
    """site-packages of a venv, an env folder holding .venv, a site-packages folder itself, or a
    torch package folder (its parent)."""
    path = Path(target).resolve()
    if (path / "torch" / "lib").is_dir():
        return path
    if path.name == "torch" and (path / "lib").is_dir():
        return path.parent
    for venv in (path, path / ".venv"):
        found = sorted(venv.glob("lib/python3*/site-packages"))
        if found:
            return found[0]
    raise ValueError(
        f"{str(target)!r} is not a site-packages, venv, env folder or torch folder "
        f"(no torch/lib found under it); pass an env name or one of those"
    )


def load_torch(site_packages: Path) -> Torch:
    """The torch installed in site_packages: its version and each torch/lib library's symbols."""
    lib_dir = site_packages / "torch" / "lib"
    if not lib_dir.is_dir():
        raise ValueError(
            f"no torch in {site_packages} ({lib_dir} missing); pass a site-packages "
            f"that has torch installed"
        )
    dists = list(metadata.distributions(name="torch", path=[str(site_packages)]))
    version = dists[0].version if dists else "?"
    libraries = {}
    for path in sorted(lib_dir.iterdir()):
        if path.is_file() and ".so" in path.name:
            symbols = read_elf(path)
            if symbols is not None:
                libraries[path.name] = symbols
    return Torch(site_packages=site_packages, version=version, libraries=libraries)


def _python_tag(site_packages: Path) -> str | None:
    """ "311" for .../lib/python3.11/site-packages; None when the path does not say."""
    match = re.fullmatch(r"python(\d)\.(\d+)", site_packages.parent.name)
    return match.group(1) + match.group(2) if match else None


def iter_extensions(site_packages: Path, torch: Torch) -> list[tuple[Path, ElfSymbols]]:
    """Every ELF file outside torch's own package that lists a torch library in DT_NEEDED."""
    found = []
    for root, dirs, files in os.walk(site_packages):
        if root == str(site_packages):
            dirs[:] = [d for d in dirs if d != "torch"]
        for fname in files:
            path = os.path.join(root, fname)
            if ".so" not in fname or os.path.islink(path):
                continue
            symbols = read_elf(Path(path), only_if_needs=torch.libraries)
            if symbols is not None:
                found.append((Path(path), symbols))
    return sorted(found)


def _skip_reason(name: str, *, python_tag: str | None, torch: Torch) -> str | None:
    tag = _PYTHON_TAG.search(name)
    if python_tag and tag and tag.group(1) != python_tag:
        return f"built for cpython-{tag.group(1)}; this env runs cpython-{python_tag}"
    # One build per torch release, the loader picking the one for the running torch
    # (torch_c_dlpack_ext's libtorch_c_dlpack_addon_torch29-cuda.so).
    tag = _TORCH_TAG.search(name)
    if tag and not re.match(rf"{tag[1]}\.{tag[2]}(?!\d)", torch.version):
        return f"built for torch {tag[1]}.{tag[2]}; loaded only next to that torch"
    return None


def check(site_packages: Path, *, torch_site_packages: Path | None = None) -> AbiReport:
    """Check the extensions in site_packages against the torch in torch_site_packages (default:
    the same site-packages)."""
    start = time.perf_counter()
    own_torch = load_torch(site_packages)
    torch = own_torch if torch_site_packages is None else load_torch(torch_site_packages)
    report = AbiReport(site_packages=site_packages, torch=torch)
    python_tag = _python_tag(site_packages)
    exports_by_scope: dict[tuple[str, ...], set[str]] = {}
    # Which libraries are torch's is decided by the env's own torch: one that the other torch
    # lacks must show up as missing, not make the extension look as if it did not link torch.
    for path, symbols in iter_extensions(site_packages, own_torch):
        rel = str(path.relative_to(site_packages))
        reason = _skip_reason(path.name, python_tag=python_tag, torch=torch)
        if reason:
            report.skipped[rel] = reason
            continue
        scope = tuple(torch.scope(symbols.needed))
        if scope not in exports_by_scope:
            exports_by_scope[scope] = set().union(*(torch.libraries[n].exported for n in scope))
        wanted = [s for s in symbols.undefined if is_torch_symbol(s)]
        report.extensions.append(
            ExtensionResult(
                path=rel,
                num_torch_symbols=len(wanted),
                missing=tuple(sorted(s for s in wanted if s not in exports_by_scope[scope])),
                missing_libraries=tuple(
                    n
                    for n in symbols.needed
                    if n in own_torch.libraries and n not in torch.libraries
                ),
            )
        )
    report.seconds = time.perf_counter() - start
    logger.debug("abi %s: %s (%.1f s)", site_packages, report.summary(), report.seconds)
    return report
