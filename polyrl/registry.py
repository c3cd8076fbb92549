"""One small registry helper for the places where plugins really plug in.

Platforms, rollout engines, weight transports, advantage estimators, policy losses and rewards
each own one `Registry`. Duplicates raise, unknown names list the valid choices, and optional
entries (heavy engines) are registered by dotted path and imported only when first asked for.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate name; the message lists the valid choices."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T | str] = {}

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

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise RegistryError(
                f"unknown {self.kind} '{name}'; valid choices: {', '.join(self.names())}"
            )
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

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


def is_file_target(target: str) -> bool:
    """"/path/to/file.py" (a user's file) rather than "package.module"."""
    return target.endswith(".py") or "/" in target or "\\" in target


def import_target(target: str, prefix: str) -> ModuleType:
    """The module of a user's "package.module" or "/path/to/file.py" (the part before ":" of a
    reward.custom_function or agent.black_box). A file is loaded once per process, as
    `prefix` + a hash of its path, so two files called reward.py do not collide; one that fails
    to load is not kept. Raises FileNotFoundError for a missing file, else what the import raises."""
    if not is_file_target(target):
        return importlib.import_module(target)
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
