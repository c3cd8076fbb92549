"""The rollout backends: the one list every other place derives from.

Config validation (`rollout.backend`, `rollout.engine_kwargs`), the engine factory, the
missing-package hints, the environment plan and `polyrl doctor` all read `ROLLOUT_BACKENDS`,
so a backend is added in one place: here for the built-in ones, or from a separate package
through the `polyrl.rollout_backends` entry-point group (`name = "module:EngineClass"`), loaded
in every process that asks (Ray workers included), or in-process with `register_backend`.

This module sits below rollout, envplan and config users on purpose: it imports nothing heavy
(engine classes are dotted paths, imported when first built).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator, Mapping

from polyrl.registry import Registry

ENTRY_POINT_GROUP = "polyrl.rollout_backends"


@dataclass(frozen=True)
class RolloutBackend:
    name: str
    engine: str
    """The engine class as a dotted path, "module:Class" (imported on first use)."""
    package: str | None = None
    """Import name of the third-party package the engine needs (None: nothing beyond polyrl)."""
    extra: str | None = None
    """The polyrl extra that installs `package` (`pip install "polyrl[extra]"`)."""
    engine_processes: bool = False
    """The engine runs in worker processes of its own on devices its host hands them (the GPU
    engines), rather than inside the polyrl process; the environment plan treats such hosts
    specially (`polyrl/envplan/plan.py`)."""

    def engine_class(self) -> type:
        module, _, attr = self.engine.partition(":")
        return getattr(importlib.import_module(module), attr)


class _Backends(Registry[RolloutBackend]):
    """A registry that first loads the entry-point plugins, whatever is asked of it."""

    def get(self, name: str) -> RolloutBackend:
        _load_entry_points()
        return super().get(name)

    def names(self) -> list[str]:
        _load_entry_points()
        return super().names()

    def __contains__(self, name: object) -> bool:
        _load_entry_points()
        return super().__contains__(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


ROLLOUT_BACKENDS: _Backends = _Backends("rollout backend")


def register_backend(name: str, engine: str, *, package: str | None = None, extra: str | None = None,
                     engine_processes: bool = False) -> RolloutBackend:
    """Add a rollout backend; `engine` is the engine class's dotted path ("module:Class")."""
    if ":" not in engine:
        raise ValueError(f"rollout backend '{name}': engine must be a dotted path 'module:Class', "
                         f"got {engine!r}")
    return ROLLOUT_BACKENDS.register(name, RolloutBackend(name, engine, package, extra, engine_processes))


register_backend("native", "polyrl.rollout.native.engine:NativeEngine")
register_backend("vllm", "polyrl.rollout.engines.vllm:VLLMEngine", package="vllm", extra="vllm",
                 engine_processes=True)
register_backend("sglang", "polyrl.rollout.engines.sglang:SGLangEngine", package="sglang",
                 extra="sglang", engine_processes=True)
register_backend("trtllm", "polyrl.rollout.engines.trtllm:TRTLLMEngine", package="tensorrt_llm",
                 extra="trtllm", engine_processes=True)


@functools.lru_cache(maxsize=1)
def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if not Registry.__contains__(ROLLOUT_BACKENDS, ep.name):
            register_backend(ep.name, ep.value)


def backend_names() -> list[str]:
    return ROLLOUT_BACKENDS.names()


def check_backend(name: str) -> str:
    """`name` if it is a registered backend, else a ValueError listing the valid ones."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"{name!r} is not one of {', '.join(backend_names())}")
    return name


class BackendView(Mapping[str, Any]):
    """A live read-only view of the backends: `select` keeps some, `value` maps each one. Live,
    so a plugin registered after import is seen wherever the view is used."""

    def __init__(self, select: Callable[[RolloutBackend], bool] = lambda b: True,
                 value: Callable[[RolloutBackend], Any] = lambda b: b):
        self._select, self._value = select, value

    def _chosen(self) -> dict[str, RolloutBackend]:
        backends = (ROLLOUT_BACKENDS.get(n) for n in ROLLOUT_BACKENDS.names())
        return {b.name: b for b in backends if self._select(b)}

    def __getitem__(self, name: str) -> Any:
        chosen = self._chosen()
        if name not in chosen:
            raise KeyError(name)
        return self._value(chosen[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._chosen())

    def __len__(self) -> int:
        return len(self._chosen())

    def __repr__(self) -> str:
        return f"BackendView({list(self)})"


ENGINE_PROCESS_BACKENDS = BackendView(lambda b: b.engine_processes)
"""Backends whose engine runs in processes of its own (the GPU engines)."""
PACKAGED_BACKENDS = BackendView(lambda b: b.package is not None, lambda b: (b.package, b.extra))
"""backend -> (import name, polyrl extra) for the backends that need a third-party package."""
