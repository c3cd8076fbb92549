"""A plan's variables in the calling process: what a Ray actor would have been started with,
for the worker that runs in the driver's own process (ray.enabled=false,
polyrl/topology/in_process.py). The caller's values come back with `restore`."""

from __future__ import annotations

import os
from collections.abc import Mapping


def apply_here(values: Mapping[str, str]) -> dict[str, str | None]:
    """Set `values` in this process's environment; returns the previous values of those that
    changed (None: unset) for `restore`. Variables read only at process start (the allocator's)
    have no effect this way."""
    previous: dict[str, str | None] = {}
    for key, value in values.items():
        if os.environ.get(key) != value:
            previous[key] = os.environ.get(key)
            os.environ[key] = value
    return previous


def restore(previous: Mapping[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
