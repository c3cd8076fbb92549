"""Loading a vision-language model for training (polyrl/training/model_loading.py ->
training/vlm.py) and LoRA on it (training/lora.py): the policy's loader takes Qwen2-VL, the
vision tower frozen unless model.train_vision_tower, and all-linear adapters skip a frozen tower."""

from __future__ import annotations

import pytest
import torch

from polyrl.training.config import ModelConfig
from polyrl.training.lora import apply_lora, check_lora_fits
from polyrl.training.model_loading import ModelLoadError, load_causal_lm
from tests.tiny_vl import build_tiny_vl


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "model")


@pytest.mark.parametrize("train_vision_tower", [False, True])
def test_policy_loader_takes_a_vlm_and_the_tower_flag(tiny_vl_dir, train_vision_tower):
    model = load_causal_lm(tiny_vl_dir, train_vision_tower=train_vision_tower)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert all(p.requires_grad == train_vision_tower for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())


@pytest.mark.parametrize("train_vision_tower", [False, True])
def test_lora_all_linear_adapts_the_tower_only_when_it_trains(tiny_vl_dir, train_vision_tower):
    cfg = ModelConfig(lora_rank=4, train_vision_tower=train_vision_tower)
    check_lora_fits(load_causal_lm(tiny_vl_dir).config, cfg)  # the pre-flight builds a VLM too
    wrapped = apply_lora(load_causal_lm(tiny_vl_dir, train_vision_tower=train_vision_tower), cfg)
    adapted = {n for n, _ in wrapped.named_parameters() if "lora_" in n}
    assert any(".language_model." in n for n in adapted)
    assert any(".visual." in n for n in adapted) == train_vision_tower


def test_an_unsupported_vlm_is_one_line(tiny_vl_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_vl_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(ModelLoadError, match=r"^model.path: a llava vision-language model; polyrl trains"):
        load_causal_lm(str(other))
