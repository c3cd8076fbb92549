"""Checks of an SFT config that need the model's shape but not its weights, run before any rank
starts (a bad LoRA setting found inside a spawned rank would cost a model load per rank and
arrive as a rank failure).

The model is built on PyTorch's meta device from its config.json: module names and layer shapes
exist, no memory is allocated and nothing is read from the weight files.
"""

from __future__ import annotations

import torch

from polyrl.training.lora import targeted_layers
from polyrl.workers.config import ModelConfig


def check_lora(model: ModelConfig) -> None:
    """Raises LoraError (one line naming model.lora_target_modules or model.lora_rank) when the
    LoRA settings cannot apply to `model.path`; does nothing when LoRA is off."""
    if not model.enabled:
        return
    targeted_layers(model_skeleton(model), model)  # the very check apply_lora makes


def model_skeleton(model: ModelConfig) -> torch.nn.Module:
    """The causal LM of `model.path` with its module tree but weights on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyrl.workers.model_loading import ModelLoadError, model_dir

    directory = model_dir(model.path)
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=model.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {directory}: {exc}") from None
