"""The contract checker the engine contract tests share, and tests of the checker itself.

`contract_gaps(root, uses, version)` reads an engine package's *source* with `ast` (the wheels do
not import without a GPU) and names every `EngineUse` (`polyrl/backends.py`) the package lacks:
a module, a class or function it does not define or re-export, a method or attribute missing
from a class and its bases, a keyword a call or constructor does not take. Imports are followed
by name, so a class re-exported through `__init__.py` or a method inherited from a mixin in
another module is found where Python would find it.

`engine_source(dist, version)` gives the unpacked sources of one release: the wheel is
`pip download --no-deps`-ed into a cache (`$POLYRL_CONTRACT_WHEELS`, else pip's own cache
directory), its `.py` files unpacked once and the downloaded wheel deleted; without a cache, or
without the index, the test skips with the reason.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from polyrl.backends import EngineUse


# --- reading a package's source -------------------------------------------------------------------

class PackageSource:
    """The modules under `root` (a directory holding top-level packages), parsed on demand."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._parsed:
            base = self.root / dotted.replace(".", "/")
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            self._parsed[dotted] = ast.parse(path.read_text(errors="replace")) if path else None
        return self._parsed[dotted]

    def is_package(self, dotted: str) -> bool:
        return (self.root / dotted.replace(".", "/") / "__init__.py").is_file()

    def resolve(self, dotted: str, name: str, seen: frozenset = frozenset()):
        """Where `name` as seen from module `dotted` is defined: ("class", module, ClassDef),
        ("function", module, FunctionDef), ("value", module, None) for an assignment, or None.
        Follows `from X import name [as alias]`, relative imports included."""
        if (dotted, name) in seen:
            return None
        seen = seen | {(dotted, name)}
        tree = self.module(dotted)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return ("class", dotted, node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return ("function", dotted, node)
        for node in ast.walk(tree):  # imports, those under try / if included
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":  # `from .common import *`
                        found = self.resolve(self._absolute(dotted, node), name, seen)
                        if found is not None:
                            return found
                    elif (alias.asname or alias.name) == name:
                        source = self._absolute(dotted, node)
                        found = self.resolve(source, alias.name, seen)
                        if found is None and self.is_package(f"{source}.{alias.name}".strip(".")):
                            return ("module", f"{source}.{alias.name}", None)
                        if found is not None:
                            return found
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ("value", dotted, None)
        return None

    def _absolute(self, dotted: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = dotted.split(".")
        package = parts if self.is_package(dotted) else parts[:-1]
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def class_chain(self, dotted: str, cls: ast.ClassDef, seen: frozenset = frozenset()):
        """(module, ClassDef) of `cls` and every base found in the package, nearest first."""
        yield dotted, cls
        for base in cls.bases:
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name is None or (dotted, name) in seen:
                continue
            found = self.resolve(dotted, name)
            if found and found[0] == "class":
                yield from self.class_chain(found[1], found[2], seen | {(dotted, name)})


def class_members(source: PackageSource, dotted: str, cls: ast.ClassDef) -> set[str]:
    """Methods, class-level fields and `self.x = ...` attributes of a class and its bases."""
    names: set[str] = set()
    for _, c in source.class_chain(dotted, cls):
        for node in c.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(c):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}, a.kwarg is not None


def accepted_keywords(source: PackageSource, dotted: str, node) -> tuple[set[str], bool]:
    """(keyword names a call accepts, whether it takes **kwargs). For a class: its nearest
    `__init__`'s parameters plus, for field-declaring classes (dataclass, pydantic, msgspec),
    the annotated fields of it and its bases."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _params(node)
    fields: set[str] = set()
    init = None
    for _, c in source.class_chain(dotted, node):
        for item in c.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields.add(item.target.id)
            if init is None and isinstance(item, ast.FunctionDef) and item.name == "__init__":
                init = item
    if init is None:
        return fields, False
    params, var_kw = _params(init)
    return params | fields, var_kw


def method_node(source: PackageSource, dotted: str, cls: ast.ClassDef, name: str):
    for _, c in source.class_chain(dotted, cls):
        for item in c.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return item
    return None


def package_fields(source: PackageSource, package: str) -> set[str]:
    """Annotated class fields of every module in `package` (a config assembled from field
    namespaces, as SGLang's `ServerArgs` is since 0.5.20)."""
    names: set[str] = set()
    for path in sorted((source.root / package.replace(".", "/")).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if isinstance(node, ast.ClassDef):
                names.update(i.target.id for i in node.body
                             if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name))
    return names


def contract_gaps(root: Path, uses: tuple[EngineUse, ...], version: str) -> list[str]:
    """Every use in `uses` (those applying to `version`) that the package under `root` lacks.
    A target "package:*" checks its keywords against the fields declared anywhere in it."""
    source = PackageSource(root)
    gaps: list[str] = []
    for use in uses:
        if use.versions and Version(version) not in SpecifierSet(use.versions):
            continue
        module, _, path = use.target.partition(":")
        if path == "*":
            missing = [k for k in use.keywords if k not in package_fields(source, module)]
            if missing:
                gaps.append(f"{use.target}: no field(s) {', '.join(missing)}")
            continue
        name, _, member = path.partition(".")
        if source.module(module) is None:
            gaps.append(f"{use.target}: no module {module}")
            continue
        found = source.resolve(module, name)
        if found is None:
            gaps.append(f"{use.target}: {module} has no {name}")
            continue
        kind, where, node = found
        call = node
        if member:
            if kind != "class":
                gaps.append(f"{use.target}: {name} is not a class")
                continue
            if member not in class_members(source, where, node):
                gaps.append(f"{use.target}: {name} has no {member}")
                continue
            call = method_node(source, where, node, member)
        if use.keywords:
            if call is None:
                gaps.append(f"{use.target}: takes no keywords (not a function or class)")
                continue
            accepted, var_kw = accepted_keywords(source, where, call)
            missing = [k for k in use.keywords if k not in accepted]
            if missing and not var_kw:
                gaps.append(f"{use.target}: no keyword(s) {', '.join(missing)}")
    return gaps


# --- getting a release's sources ------------------------------------------------------------------

def wheel_cache() -> Path | None:
    """$POLYRL_CONTRACT_WHEELS, else a folder in pip's cache; None when neither exists."""
    if os.environ.get("POLYRL_CONTRACT_WHEELS"):
        return Path(os.environ["POLYRL_CONTRACT_WHEELS"])
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return Path(out.stdout.strip()) / "polyrl-contract-wheels"


@lru_cache(maxsize=None)
def engine_source(dist: str, package: str, version: str) -> Path:
    """A directory holding `package`'s `.py` files from the `dist==version` wheel; skips the
    test (with the reason) when the wheel cannot be had here."""
    cache = wheel_cache()
    if cache is None:
        pytest.skip("no wheel cache: set POLYRL_CONTRACT_WHEELS to a writable folder")
    unpacked = cache / f"{dist}-{version}-src"
    if (unpacked / ".complete").is_file():
        return unpacked
    cache.mkdir(parents=True, exist_ok=True)
    prefix = f"{dist.replace('-', '_')}-{version}-"
    wheel = next((w for w in sorted(cache.glob("*.whl")) if w.name.startswith(prefix)), None)
    downloaded = wheel is None
    if wheel is None:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "--disable-pip-version-check", f"{dist}=={version}", "-d", str(cache)],
                             capture_output=True, text=True, timeout=600)
        wheel = next((w for w in sorted(cache.glob("*.whl")) if w.name.startswith(prefix)), None)
        if wheel is None:
            reason = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"{dist}=={version}: no wheel here ({reason[:200]})")
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.startswith(f"{package}/") and info.filename.endswith(".py"):
                zf.extract(info, unpacked)
    (unpacked / ".complete").write_text(wheel.name)
    if downloaded:  # the sources are what is read; a wheel put there by hand stays
        wheel.unlink()
    return unpacked


# --- the checker, on a package written here -------------------------------------------------------

def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


ENGINE_PKG = {
    "eng/__init__.py": "from .core.engine import Engine\n__all__ = ['Engine']\n",
    "eng/core/__init__.py": "",
    "eng/core/mixin.py": "class Control:\n    async def flush(self, obj, request=None):\n        pass\n",
    "eng/core/engine.py": (
        "from dataclasses import dataclass\n"
        "from eng.core.mixin import Control as _Control\n"
        "class Engine(_Control):\n"
        "    def __init__(self, **kwargs):\n"
        "        self.manager = object()\n"
        "    async def generate(self, input_ids=None, *, rid=None):\n"
        "        pass\n"
        "@dataclass\n"
        "class Req:\n"
        "    tags: list\n"
        "    flush_cache: bool = True\n"),
}


def test_the_checker_follows_reexports_mixins_and_fields(tmp_path):
    root = write(tmp_path, ENGINE_PKG)
    good = (EngineUse("eng:Engine"), EngineUse("eng.core.engine:Engine.flush"),
            EngineUse("eng.core.engine:Engine.manager"),
            EngineUse("eng.core.engine:Engine.generate", ("input_ids", "rid")),
            EngineUse("eng.core.engine:Req", ("tags", "flush_cache")),
            EngineUse("eng:Engine", ("anything",)))  # **kwargs takes any keyword
    assert contract_gaps(root, good, "1.0") == []


def test_the_checker_names_what_is_missing(tmp_path):
    root = write(tmp_path, ENGINE_PKG)
    bad = (EngineUse("eng:Server"), EngineUse("eng.core.engine:Engine.begin_update"),
           EngineUse("eng.core.engine:Engine.generate", ("input_ids", "seed")),
           EngineUse("eng.core.engine:Req", ("tags", "selector")), EngineUse("eng.gone:X"),
           EngineUse("eng:Server", versions="<1.0"))  # does not apply to 1.0
    assert contract_gaps(root, bad, "1.0") == [
        "eng:Server: eng has no Server",
        "eng.core.engine:Engine.begin_update: Engine has no begin_update",
        "eng.core.engine:Engine.generate: no keyword(s) seed",
        "eng.core.engine:Req: no keyword(s) selector",
        "eng.gone:X: no module eng.gone",
    ]
