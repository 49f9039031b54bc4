"""A released Megatron-Bridge's own modules, imported without the package ``__init__``s that need Transformer Engine.

``import megatron.bridge`` runs the package's ``__init__``, which imports every model bridge and, with them,
Transformer Engine, which a CPU machine cannot install. The modules vdpcp runs (Qwen3-VL's
``modelling_qwen3_vl.model`` and ``.utils``, and what they import) need only megatron-core and transformers.
``load`` imports them as Python would, from the release's own files, except that every package of the release is a
bare package module (its ``__path__`` and nothing run) instead of its ``__init__``. Nothing is patched or copied:
every function is the release's, from its own file.

Where a release comes from:

- ``load()``: the installed megatron-bridge (requirements/no-deps.txt pins it, installed without its dependencies);
- ``load("0.5.0")``: an older release held as a regression fixture, installed without its dependencies into
  ``<environment>/releases/megatron-bridge-VERSION`` (requirements/releases.txt; ./run and tox install it there),
  a folder never on ``sys.path``.

Two releases in one process never mix: a load takes every ``megatron.bridge`` module out of ``sys.modules``, imports
the release's modules through a finder that answers ``megatron.bridge*`` from that release's folder alone, keeps
the module objects, then puts ``sys.modules`` back as it was. A function of the release that imported
``megatron.bridge`` by name when it runs would then get another release's module, or none. The released modules do
that in one place (``lazy_imports`` finds them: Bridge's ``TransformerConfig`` resolves a config field given as a
string, which vdpcp never gives), so every call into a release runs inside ``Release.running()``: an import of
``megatron.bridge`` by name there raises ReleaseError naming it, instead of mixing releases.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

DISTRIBUTION = "megatron-bridge"
PACKAGE = "megatron.bridge"
QWEN3_VL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl"
QWEN3_VL_MODULES = (f"{QWEN3_VL}.model", f"{QWEN3_VL}.utils")
RELEASES = "releases"  # <environment>/releases/NAME-VERSION: requirements/install-releases puts them there


class ReleaseError(ImportError):
    """A release that is not installed where vdpcp looks, or whose modules cannot be held apart from another's."""


@dataclass(frozen=True)
class Release:
    """One release's modules by name, imported from ``root`` (the folder that holds its ``megatron/bridge``)."""

    version: str
    root: Path
    modules: dict[str, ModuleType]

    def __getitem__(self, name: str) -> ModuleType:
        return self.modules[name]

    @contextmanager
    def running(self):
        """Around a call into the release: importing ``megatron.bridge`` by name inside it raises ReleaseError."""
        guard = _Sealed(self)
        sys.meta_path.insert(0, guard)
        try:
            yield
        finally:
            sys.meta_path.remove(guard)


def distribution(version: str | None = None) -> importlib.metadata.Distribution:
    """The installed megatron-bridge (``version`` None or its own), or an older release's from its folder."""
    if version is None:
        return importlib.metadata.distribution(DISTRIBUTION)
    installed = importlib.metadata.distribution(DISTRIBUTION)
    if installed.version == version:
        return installed
    folder = Path(sys.prefix) / RELEASES / f"{DISTRIBUTION}-{version}"
    found = list(importlib.metadata.distributions(name=DISTRIBUTION, path=[str(folder)]))
    if len(found) != 1 or found[0].version != version:
        raise ReleaseError(f"{DISTRIBUTION} {version} is not installed at {folder} (found "
                           f"{[d.version for d in found] or 'nothing'}); expected requirements/releases.txt's pin, "
                           f"installed there by ./run or `requirements/install-releases PYTHON`")
    return found[0]


def load(version: str | None = None, names: tuple[str, ...] = QWEN3_VL_MODULES) -> Release:
    """Import ``names`` (and what they import of the release) from one release, once a process; ``sys.modules`` is
    left as it was."""
    return _load(version, tuple(names))


@functools.cache  # called one way only, so a release is loaded once, whichever way load was called
def _load(version: str | None, names: tuple[str, ...]) -> Release:
    dist = distribution(version)
    root = Path(dist.locate_file("")).resolve()
    if not (root / "megatron" / "bridge").is_dir():
        raise ReleaseError(f"{DISTRIBUTION} {dist.version}: no megatron/bridge under {root}")
    aside = {name: sys.modules.pop(name) for name in list(sys.modules) if _ours(name)}
    finder = _ReleaseFinder(root)
    sys.meta_path.insert(0, finder)
    try:
        for name in names:
            importlib.import_module(name)
        loaded = {name: module for name, module in sys.modules.items() if _ours(name)}
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(aside)
    return Release(dist.version, root, loaded)


def lazy_imports(release: Release) -> dict[str, str]:
    """Where a loaded module of ``release`` imports ``megatron.bridge`` inside a function: "file:line" -> the
    function's name. Such an import, run after ``load``, would find whatever ``sys.modules`` holds then."""
    found = {}
    for module in release.modules.values():
        path = getattr(module, "__file__", None)
        if path is None:
            continue  # a bare package: nothing of it runs
        tree = ast.parse(Path(path).read_text())
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(function):
                    if _imports_release(node):
                        found[f"{Path(path).relative_to(release.root)}:{node.lineno}"] = function.name
    return found


def _imports_release(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(_ours(alias.name) for alias in node.names)
    return isinstance(node, ast.ImportFrom) and not node.level and _ours(node.module or "")


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


class _ReleaseFinder(importlib.abc.MetaPathFinder):
    """``megatron.bridge*`` from one release's folder: a package as a bare module, a module from its file."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if not _ours(name):
            return None
        where = self.root.joinpath(*name.split("."))
        if (where / "__init__.py").is_file():
            spec = importlib.machinery.ModuleSpec(name, _BareLoader(), origin=None, is_package=True)
            spec.submodule_search_locations = [str(where)]
            return spec
        if where.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None


class _Sealed(importlib.abc.MetaPathFinder):
    """Refuses ``megatron.bridge*`` by name while a release runs: the name would not be the release's."""

    def __init__(self, release: Release):
        self.release = release

    def find_spec(self, name, path=None, target=None):
        if _ours(name):
            raise ReleaseError(f"{DISTRIBUTION} {self.release.version} imported {name} by name while running; "
                               f"vdpcp holds the release's modules apart from sys.modules (vdpcp.impls.bridge_release)")
        return None


class _BareLoader(importlib.abc.Loader):
    """A package whose ``__init__`` is not run: its submodules are found, nothing it would import is."""

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module):
        pass
