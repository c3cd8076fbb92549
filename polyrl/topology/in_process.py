"""ray.enabled=false: the run's workers as plain objects in the calling process.

`LocalActor` offers a worker object through the surface a Ray actor handle offers the worker
groups (polyrl/topology/worker_group.py): `actor.method.remote(*args)`. The call runs at once,
in this thread, and its "ref" is its answer; `local_gather` is the matching waiter. So the
Trainer, the topology and the worker classes are the same code in both modes, a debugger
stops inside a worker, and nothing is spawned.

A Ray actor is a process of its own, with its own random state: the worker seeds torch in its
set-up, and the driver draws from its own generators meanwhile. So that the same seed gives the
same run in both modes, each `LocalActor` keeps its own random state (torch's on the CPU and the
accelerator, numpy's, Python's) and swaps it in around each call.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class RandomState:
    """torch (CPU, and the devices of `devices`, the platform's torch module, once it is
    initialised), numpy and Python random state."""

    def __init__(self, devices: Any = None) -> None:
        self.torch = torch.get_rng_state()
        self.devices = devices if devices is not None and devices.is_initialized() else None
        self.device_states = self.devices.get_rng_state_all() if self.devices is not None else None
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.devices is not None:
            self.devices.set_rng_state_all(self.device_states)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


class _Method:
    def __init__(self, actor: "LocalActor", name: str):
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.run(self.name, args, kwargs)


class LocalActor:
    """A worker object called like a Ray actor handle, in this process (see the module)."""

    def __init__(self, worker: Any, platform: Any = None):
        self.worker = worker
        self.devices = platform.device_module() if platform is not None and platform.ray_resource else None
        """The platform's torch device module (`Platform.device_module`; None on CPU)."""
        self.random: RandomState | None = None
        """The worker's own random state between calls (None before its first call: it starts
        from the state a fresh process would have had at that point, the caller's)."""

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def run(self, method: str, args: tuple, kwargs: dict) -> Any:
        caller = RandomState(self.devices)
        if self.random is not None:
            self.random.restore()
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        finally:
            self.random = RandomState(self.devices)
            caller.restore()


def local_gather(refs: Sequence[Any], names: Sequence[str], *, phase: str, timeout_s: float) -> list[Any]:
    """The waiter of in-process groups: the calls already ran, their refs are their answers."""
    return list(refs)


def is_local(worker: Any) -> bool:
    return isinstance(worker, LocalActor)
