"""LoRA settings (a config leaf: `model.lora_*` keys, training/lora.py applies them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl.config import Config


class LoraConfig(Config):
    lora_rank: int = Field(0, ge=0)
    """LoRA rank; 0 trains the full model. With a rank, only the adapters train and hold
    optimizer state; the engines receive merged weights."""
    lora_alpha: float | None = Field(None, gt=0)
    """LoRA scaling numerator (updates are scaled by lora_alpha / lora_rank); null: 2 x lora_rank."""
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names that get adapters (e.g. [q_proj, v_proj]), or all-linear: every linear layer
    but the output head (on a mixture-of-experts model also the experts' fused tensors; docs/moe.md)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input during training."""
    lora_lr_scale: float = Field(10.0, gt=0)
    """The adapters train at actor.lr x this (LoRA's low-rank updates need a larger step than
    full fine-tuning: on the embedded task 10x learns about as fast as full training at 1x)."""

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
