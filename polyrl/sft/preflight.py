"""Checks of an SFT config that need the model's shape but not its weights, run before any rank
starts (a bad LoRA setting found inside a spawned rank would cost a model load per rank and
arrive as a rank failure).

The model is built on PyTorch's meta device from its config.json: module names and layer shapes
exist, no memory is allocated and nothing is read from the weight files.
"""

from __future__ import annotations

from polyrl.training.lora import LoraError, check_lora_fits
from polyrl.training.config import ModelConfig


def check_lora(model: ModelConfig) -> None:
    """Raises LoraError (one line naming model.lora_target_modules or model.lora_rank) when the
    LoRA settings cannot apply to `model.path`; does nothing when LoRA is off."""
    if not model.enabled:
        return
    from transformers import AutoConfig

    from polyrl.training.model_loading import ModelLoadError, model_dir

    directory = model_dir(model.path)
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=model.trust_remote_code)
        check_lora_fits(config, model, model.trust_remote_code)  # the very check apply_lora makes
    except LoraError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {directory}: {exc}") from None
