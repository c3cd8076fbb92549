"""Build the rollout engine a config asks for; engines that need an extra say which.

Every engine, the built-in one included, is started with `engine_launch_args(...)`, the same
pure function `polyrl train --dry-run` prints (for the installed engine version), so a layout or
an `engine_kwargs` entry the dry run refuses is refused here with the same line, before any
engine starts. A missing engine package or one outside the versions polyrl supports
(`polyrl/backends.py`) is one line naming the pip command.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import torch

from polyrl.backends import (
    PACKAGED_BACKENDS,
    ROLLOUT_BACKENDS,
    BackendError,
    feature_version_problem,
    installed_engine_version,
    version_problem,
)
from polyrl.platform import Platform, current_platform
from polyrl.rollout.base import ROLLOUT_ENGINES
from polyrl.rollout.config import RolloutConfig

EXTRAS = PACKAGED_BACKENDS
"""backend -> (import name, polyrl extra that installs it), from `polyrl/backends.py`."""


class EngineUnavailable(RuntimeError):
    pass


def require_backend(backend: str) -> None:
    """One-line error naming the extra to install when an engine is missing, or the version to
    install when the installed one is outside polyrl's supported range; for a plugin named by
    import path (or entry point) that cannot be used, what is wrong with it. In a Ray worker
    this is where a plugin is first imported."""
    try:
        ROLLOUT_BACKENDS.get(backend)
    except BackendError as exc:
        raise EngineUnavailable(f"rollout.backend: {exc}") from None
    except KeyError:
        raise EngineUnavailable(
            f"rollout.backend={backend}: no adapter is registered in this polyrl version; "
            f"available: {', '.join(ROLLOUT_ENGINES.names())}"
        ) from None
    if backend in EXTRAS:
        module, extra = EXTRAS[backend]
        if importlib.util.find_spec(module) is None:
            raise EngineUnavailable(
                f"rollout.backend={backend} needs the {module} package: pip install \"polyrl[{extra}]\""
            )
        problem = version_problem(backend, installed_version(backend))
        if problem:
            raise EngineUnavailable(problem)


def check_engine_features(cfg: RolloutConfig) -> None:
    """One line (EngineUnavailable) when the run asks its engine for a capability the installed
    version is below the floor of (`EngineCapabilities.since`, polyrl/backends.py): FP8 weight
    updates here; image prompts are judged by the pre-flight, which sees the data."""
    if cfg.quantization == "fp8":
        problem = feature_version_problem(cfg.backend, "fp8", installed_version(cfg.backend),
                                          "rollout.quantization=fp8")
        if problem:
            raise EngineUnavailable(problem)


def installed_version(backend: str) -> str | None:
    """The installed engine package's version (None for the built-in engine or when absent)."""
    if backend not in EXTRAS:
        return None
    return installed_engine_version(backend)


def _is_gpu_adapter(engine_cls: type) -> bool:
    from polyrl.rollout.engines.common import AsyncEngineAdapter

    return isinstance(engine_cls, type) and issubclass(engine_cls, AsyncEngineAdapter)


def engine_args(cfg: RolloutConfig, model_path: str, platform: Platform | None = None, *,
                colocated: bool) -> dict[str, Any]:
    """The launch arguments of `cfg.backend` for the installed engine version (the dry run's):
    a builder's for the built-in and GPU engines, polyrl's settings plus `engine_kwargs` for a
    plugin engine in this process (`launch_args.engine_launch_args`). `colocated`: the engine
    shares its process with a policy rank (the actor's RolePlan says)."""
    from polyrl.rollout.launch_args import engine_launch_args

    return engine_launch_args(cfg, model_path, platform or current_platform(),
                              installed_version(cfg.backend), colocated=colocated)


def colocated_engine_streams(cfg: RolloutConfig) -> bool:
    """Whether a colocated engine can start from the trainer's first streamed weight sync rather
    than from the policy's whole module: a GPU engine, which starts on dummy weights anyway. The
    built-in engine keeps a whole copy of its own (and a packed one) built from the module: a
    sharded policy load would not lower its rank's peak (measured, docs/scaling.md)."""
    return _is_gpu_adapter(ROLLOUT_ENGINES.get(cfg.backend))


def build_colocated_engine(cfg: RolloutConfig, model: torch.nn.Module, tokenizer: Any,
                           device: torch.device, seed: int = 0, platform: Platform | None = None,
                           first_weights: Any = None):
    """An engine in this process that starts from `model`'s weights (colocated placement), or, for a
    GPU engine given `first_weights` (the training engine's weight stream, the policy loaded
    sharded), from dummy weights overwritten by that stream: every trainer rank loads its own
    engine at once, as the stream's gathers are collectives."""
    require_backend(cfg.backend)
    check_engine_features(cfg)
    engine_cls = ROLLOUT_ENGINES.get(cfg.backend)
    if _is_gpu_adapter(engine_cls):
        model_path = getattr(getattr(model, "config", None), "_name_or_path", "")
        if not model_path:
            raise ValueError("the policy model has no config._name_or_path: a GPU engine needs the "
                             "model directory for its config and tokenizer (set model.path)")
        args = engine_args(cfg, model_path, platform, colocated=True)
        if first_weights is not None:
            engine = engine_cls(args, tokenizer=tokenizer, seed=seed, update_bucket_mb=cfg.update_bucket_mb)
            engine.update_weights(first_weights, 0)
            return engine
        return engine_cls.from_model(model, launch_args=args, tokenizer=tokenizer, seed=seed,
                                     update_bucket_mb=cfg.update_bucket_mb)
    if first_weights is not None:
        raise ValueError(f"rollout.backend={cfg.backend}: the built-in engine starts from the policy's module, "
                         "not a weight stream")
    # the built-in engine: the launch arguments the dry run shows, less the model path
    args = engine_args(cfg, "", platform, colocated=True)
    args.pop("model_path")
    return engine_cls.from_model(model, tokenizer=tokenizer, device=device, seed=seed, **args)


def build_disaggregated_engine(cfg: RolloutConfig, model_path: str, device: torch.device, seed: int = 0,
                            platform: Platform | None = None, trust_remote_code: bool = False,
                            tokenizer_path: str | None = None):
    """An engine that loads the policy's initial weights from disk (disaggregated placement); later
    versions arrive through the weight transport. Its tokenizer is loaded here, by the loader
    every layer shares, so `model.trust_remote_code` / `model.tokenizer_path` hold for replicas
    as they do for the trainer."""
    require_backend(cfg.backend)
    check_engine_features(cfg)
    from polyrl.builtin import resolve
    from polyrl.modeling import load_tokenizer

    engine_cls = ROLLOUT_ENGINES.get(cfg.backend)
    tokenizer = load_tokenizer(tokenizer_path or model_path, trust_remote_code)
    if _is_gpu_adapter(engine_cls):
        args = engine_args(cfg, str(resolve(model_path)), platform, colocated=False)
        return engine_cls(args, tokenizer=tokenizer, seed=seed, update_bucket_mb=cfg.update_bucket_mb)
    args = engine_args(cfg, str(resolve(model_path)), platform, colocated=False)
    return engine_cls(args.pop("model_path"), tokenizer=tokenizer, device=device, seed=seed, **args)


def check_engine_launch(cfg: RolloutConfig, model_path: str, platform: Platform | None = None, *,
                        colocated: bool) -> None:
    """Everything about the rollout engine that can fail before any actor starts, as one line
    (EngineUnavailable or ValueError): the engine package present and inside its supported
    range, and its launch arguments buildable (`launch_args.check_launch`, nulls, FP8, native
    keys). For the trainer's pre-flight; the engines run the same checks when built."""
    from polyrl.builtin import resolve
    from polyrl.rollout.launch_args import check_replica_layout

    require_backend(cfg.backend)
    check_engine_features(cfg)
    check_replica_layout(cfg)
    engine_args(cfg, str(resolve(model_path)), platform, colocated=colocated)
    if cfg.backend == "native":  # an architecture it does not run (a mixture-of-experts router shape)
        from polyrl.rollout.native.loader import check_model_dir

        check_model_dir(resolve(model_path))
