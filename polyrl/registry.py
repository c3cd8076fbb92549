"""One small registry helper for the places where plugins really plug in.

Platforms, rollout engines, weight transports, advantage estimators, policy losses, environments,
tools and rewards each own one `Registry`. Duplicates raise, unknown names list the valid
choices, and optional entries (heavy engines) are registered by dotted path and imported only
when first asked for.

A registry that plugins extend (docs/plugins.md) is built with an entry-point group, whose
entries (`name = "module:attr"`) it registers the first time it is asked anything, and with
`import_paths=True`, so a config may also name an object outside polyrl directly as
"package.module:name" or "/path/to/file.py:name". Both are resolved in whichever process asks
(the driver's config check, every Ray worker), so nothing has to be registered by hand.

`load_plugin` is the one loader of such an import path, for the registries and for every other
key that names a user's code (tools, reward functions, black-box agents, rollout backends).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Generic, Iterator, TypeVar

from polyrl.config.targets import IMPORT_PATH_FORMS, is_file_target, is_import_path

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate name; the message lists the valid choices."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str, *, entry_point_group: str | None = None, import_paths: bool = False):
        """`entry_point_group`: packages register entries there (`name = "module:attr"`), loaded
        on the first question asked; `import_paths`: `get` also takes "module:name" and
        "/path/to/file.py:name" (imported once per process)."""
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.import_paths = import_paths
        self._entries: dict[str, T | str] = {}
        self._plugins: dict[str, Any] = {}
        self._entry_points_loaded = entry_point_group is None

    def register(self, name: str, obj: T | str | None = None):
        """Register `obj` (or a dotted path "module:attr" loaded lazily) under `name`.

        Used directly or as a decorator: `@REGISTRY.register("grpo")`.
        """
        if obj is None:
            def decorator(o: T) -> T:
                self.register(name, o)
                return o
            return decorator
        if name in self._entries:
            raise RegistryError(f"{self.kind} '{name}' is already registered")
        self._entries[name] = obj
        return obj

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.entry_point_group):  # type: ignore[arg-type]
            if ep.name not in self._entries:  # one registered in code first keeps its name
                self._entries[ep.name] = ep.value

    def get(self, name: str) -> T:
        self._load_entry_points()
        if name not in self._entries:
            if self.import_paths and is_import_path(name):
                return self._plugin(name)
            raise RegistryError(f"unknown {self.kind} '{name}'; valid choices: {self.choices()}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def _plugin(self, spec: str) -> Any:
        """The object an import path names, loaded once per process; a RegistryError of one
        line (naming the spec and what went wrong) when it cannot be."""
        if spec in self._plugins:
            return self._plugins[spec]
        slug = "".join(c if c.isalnum() else "_" for c in self.kind)
        try:
            obj = load_plugin(spec, f"polyrl_user_{slug}_")
        except PluginLoadError as exc:
            if exc.stage == "import":
                raise RegistryError(f"{self.kind} {exc} (is its directory on PYTHONPATH? docs/plugins.md)") from None
            raise RegistryError(f"{self.kind} {exc}") from None
        self._plugins[spec] = obj
        return obj

    def names(self) -> list[str]:
        """The registered names (entry points included), not the import paths also accepted."""
        self._load_entry_points()
        return list(self._entries)

    def choices(self) -> str:
        """The valid choices as an error message lists them."""
        names = ", ".join(self.names())
        if not self.import_paths:
            return names or "(none registered)"
        return f"{names}, or {IMPORT_PATH_FORMS}" if names else IMPORT_PATH_FORMS

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> Iterator[tuple[str, T]]:
        for name in list(self._entries):
            yield name, self.get(name)


def lazy(factory: Callable[[], T]) -> Callable[[], T]:
    """Memoise a zero-argument factory: evaluated on first call, never at import."""
    cache: list[T] = []

    def get() -> T:
        if not cache:
            cache.append(factory())
        return cache[0]

    return get


class PluginLoadError(ImportError):
    """Why an object named by import path could not be loaded. `stage` says which step failed:
    "form" (not "target:name"), "file" (no such file), "import" (an ImportError while importing
    `target`), "raised" (the module raised something else while it was imported) or "attribute"
    (`module` has no `attr`). `cause` is what was raised. Each caller words its own one line,
    naming its config key, from these fields; str() is a generic one."""

    def __init__(self, stage: str, spec: str, target: str, attr: str, *,
                 cause: BaseException | None = None, module: ModuleType | None = None):
        self.stage, self.spec, self.target, self.attr = stage, spec, target, attr
        self.cause, self.module = cause, module
        super().__init__(self._describe())

    def _describe(self) -> str:
        if self.stage == "form":
            return f"'{self.spec}' must look like {IMPORT_PATH_FORMS}"
        if self.stage == "file":
            return f"'{self.spec}': file {self.cause} does not exist"
        if self.stage == "import":
            return f"'{self.spec}': cannot import '{self.target}': {_one_line(self.cause)}"  # type: ignore[arg-type]
        if self.stage == "raised":
            return (f"'{self.spec}': importing '{self.target}' raised {type(self.cause).__name__}: "
                    f"{_one_line(self.cause)}")  # type: ignore[arg-type]
        return (f"'{self.spec}': '{self.target}' has no '{self.attr}'; defined there: "
                f"{', '.join(defined_callables(self.module)) or '(nothing callable)'}")  # type: ignore[arg-type]


def load_plugin(spec: str, prefix: str, *, callable_only: bool = False) -> Any:
    """The object "package.module:name" or "/path/to/file.py:name" names: the one plugin loader
    (registries, tools, reward functions, black-box agents, rollout backends all call it; tests/
    plugins/test_plugin_loader.py keeps it the only one). Files load once per process under
    `prefix` + a hash of their path (`import_target`). `callable_only`: a name that is not
    callable counts as missing (a function was asked for). Raises PluginLoadError."""
    target, _, attr = spec.rpartition(":")  # rpartition: a Windows path may hold "C:"
    if not target or not attr:
        raise PluginLoadError("form", spec, target, attr)
    try:
        module = import_target(target, prefix)
    except FileNotFoundError as exc:
        raise PluginLoadError("file", spec, target, attr, cause=exc) from exc
    except ImportError as exc:
        raise PluginLoadError("import", spec, target, attr, cause=exc) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while it was imported
        raise PluginLoadError("raised", spec, target, attr, cause=exc) from exc
    obj = getattr(module, attr, None)
    if not hasattr(module, attr) or (callable_only and not callable(obj)):
        raise PluginLoadError("attribute", spec, target, attr, module=module)
    return obj


def defined_callables(module: ModuleType) -> list[str]:
    """The public callables `module` itself defines (not those it imports): what an error about a
    missing name lists."""
    return [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__]


def import_target(target: str, prefix: str) -> ModuleType:
    """The module of a user's "package.module" or "/path/to/file.py" (the part before ":" of a
    reward.custom_function or agent.black_box). A file is loaded once per process, as
    `prefix` + a hash of its path, so two files called reward.py do not collide; one that fails
    to load is not kept. A "package.module" that is nowhere on sys.path is looked for in the
    directory the process runs in last (`import_module`). Raises FileNotFoundError for a missing
    file, else what the import raises."""
    if not is_file_target(target):
        return import_module(target)
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(str(path))
    name = prefix + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    with _FILE_LOADS:  # concurrent callers (agent threads) must not see a half-executed module
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[name] = module  # during exec too: dataclasses in the file look it up
            try:
                spec.loader.exec_module(module)  # type: ignore[union-attr]
            except BaseException:
                del sys.modules[name]
                raise
    return module


_FILE_LOADS = threading.RLock()


def import_module(name: str) -> ModuleType:
    """`importlib.import_module`, and if the top-level package is nowhere on sys.path, once more
    with the directory the process runs in appended to it: `polyrl train` started as a console
    script does not have that directory on its path (`python -m polyrl` does, and Ray puts the
    driver's directory on every worker's path), so a plugin package beside the config is found
    either way. Appended, not prepended: it never shadows an installed module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        run_dir = os.getcwd()
        if exc.name != name.partition(".")[0] or run_dir in sys.path or "" in sys.path:
            raise
        sys.path.append(run_dir)
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            sys.path.remove(run_dir)  # not found there either: leave the path as it was
            raise


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


__all__ = ["PluginLoadError", "Registry", "RegistryError", "defined_callables", "import_module", "import_target",
           "is_file_target", "lazy", "load_plugin"]
