"""Build the rollout engine a config asks for; engines that need an extra say which."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from polyrl.rollout.base import ROLLOUT_ENGINES
from polyrl.rollout.config import RolloutConfig

EXTRAS = {"vllm": ("vllm", "vllm"), "sglang": ("sglang", "sglang"), "trtllm": ("tensorrt_llm", "trtllm")}


class EngineUnavailable(RuntimeError):
    pass


def require_backend(backend: str) -> None:
    """One-line error naming the extra to install when an engine is missing."""
    if backend in EXTRAS:
        module, extra = EXTRAS[backend]
        if importlib.util.find_spec(module) is None:
            raise EngineUnavailable(
                f"rollout.backend={backend} needs the {module} package: pip install \"polyrl[{extra}]\""
            )
    if backend not in ROLLOUT_ENGINES:
        raise EngineUnavailable(
            f"rollout.backend={backend}: no adapter is registered in this polyrl version; "
            f"available: {', '.join(ROLLOUT_ENGINES.names())}"
        )


def build_colocated_engine(cfg: RolloutConfig, model: torch.nn.Module, tokenizer: Any,
                           device: torch.device, seed: int = 0):
    """An engine in this process that starts from `model`'s weights (hybrid placement)."""
    require_backend(cfg.backend)
    engine_cls = ROLLOUT_ENGINES.get(cfg.backend)
    kwargs = dict(cfg.engine_kwargs.get(cfg.backend, {}))
    return engine_cls.from_model(
        model, tokenizer=tokenizer, dtype=cfg.dtype, device=device,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, seed=seed, **kwargs,
    )


def build_standalone_engine(cfg: RolloutConfig, model_path: str, device: torch.device, seed: int = 0):
    """An engine that loads the policy's initial weights from disk (standalone placement); later
    versions arrive through the weight transport."""
    require_backend(cfg.backend)
    from polyrl.builtin import resolve

    engine_cls = ROLLOUT_ENGINES.get(cfg.backend)
    kwargs = dict(cfg.engine_kwargs.get(cfg.backend, {}))
    return engine_cls(resolve(model_path), dtype=cfg.dtype, device=device,
                      max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, seed=seed,
                      **kwargs)
