"""The exact arguments each rollout engine is started with, built by pure functions.

`engine_launch_args` is what both the rollout actors and `polyrl train --dry-run` call, so the
plan a user inspects is the plan that runs. Builders take the config and the (possibly
simulated) platform and never import the engine: they run on a laptop without a GPU.
Defaults come first, the user's `rollout.engine_kwargs.<engine>` last, `None` values dropped.
"""

from __future__ import annotations

from typing import Any, Callable

from polyrl.platform import Platform
from polyrl.rollout.config import RolloutConfig

Builder = Callable[[RolloutConfig, str, Platform, "str | None"], dict[str, Any]]


def merge_args(defaults: dict[str, Any], user: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults, then the user's values key by key; `None` values are dropped."""
    merged = {**defaults, **(user or {})}
    return {k: v for k, v in merged.items() if v is not None}


def native_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                engine_version: str | None = None) -> dict[str, Any]:
    defaults = {"model_path": model_path, "dtype": rollout.dtype,
                "max_model_len": rollout.max_model_len, "max_num_seqs": rollout.max_num_seqs}
    return merge_args(defaults, rollout.engine_kwargs.get("native"))


BUILDERS: dict[str, Builder] = {"native": native_args}


def engine_launch_args(rollout: RolloutConfig, model_path: str, platform: Platform,
                       engine_version: str | None = None) -> dict[str, Any]:
    """Keyword arguments the engine of `rollout.backend` is constructed with.

    `engine_version` is the engine package's version when known (installed, or declared for a
    dry run); builders whose defaults depend on it document what None means."""
    if rollout.backend not in BUILDERS:
        raise ValueError(f"rollout.backend={rollout.backend}: no launch-argument builder; "
                         f"available: {', '.join(sorted(BUILDERS))}")
    return BUILDERS[rollout.backend](rollout, model_path, platform, engine_version)
