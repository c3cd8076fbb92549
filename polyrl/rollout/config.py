"""Rollout configuration: which engine, where it runs, and how it samples."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from polyrl.config import Config


class RolloutConfig(Config):
    backend: Literal["native", "vllm", "sglang", "trtllm"] = "native"
    """Rollout engine: the built-in PyTorch engine (runs anywhere) or a GPU engine."""
    placement: Literal["hybrid", "standalone"] = "hybrid"
    """hybrid: the engine shares the trainer's devices, weights synced in place;
    standalone: rollout replicas on their own devices, weights sent over a collective."""
    n: int = Field(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature for training rollouts (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass for training rollouts."""
    top_k: int = Field(-1, ge=-1)
    """Top-k filter for training rollouts (-1 disables)."""
    response_length: int = Field(512, ge=1)
    """Most tokens generated per response."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + response the engine accepts (default: max prompt + response length)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight and activation dtype."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences decoded together in one engine step."""
    num_replicas: int = Field(1, ge=1)
    """Rollout replicas (standalone placement)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices per rollout replica."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of device memory a GPU engine may take (KV cache included)."""
    engine_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Extra launch arguments per engine, e.g. {"vllm": {"enforce_eager": true}}; applied last."""
    val_temperature: float = Field(0.0, ge=0)
    """Sampling temperature for validation (0 = greedy)."""
    val_n: int = Field(1, ge=1)
    """Samples per validation prompt (pass@k uses k = val_n)."""

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.placement == "hybrid" and self.num_replicas > 1:
            raise ValueError(
                "num_replicas > 1 needs rollout.placement=standalone (hybrid placement runs one "
                "engine per trainer rank)"
            )
        unknown = set(self.engine_kwargs) - {"native", "vllm", "sglang", "trtllm"}
        if unknown:
            raise ValueError(
                f"engine_kwargs has unknown engine(s) {sorted(unknown)}; "
                "use native, vllm, sglang or trtllm"
            )
        return self
