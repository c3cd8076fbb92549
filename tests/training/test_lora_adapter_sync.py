"""rollout.lora_mode=adapter, the CPU-testable parts: which tensors a LoRA policy sends (the
adapter alone, B pre-scaled), the peft directory the vLLM adapter writes from them (loaded here
with peft: the logits of the merged weights), the LoRARequest it builds, the launch arguments and
the config errors. The vLLM engine itself: tests/rollout/engines/test_engine_adapters_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.rollout.base import WeightUpdateError
from polyrl.rollout.engines.vllm import adapter_files, is_adapter_update, lora_request_kwargs
from polyrl.training.lora import (LoraConfig, adapter_named_tensors, adapter_specs, apply_lora,
                                  merged_named_weights)


@pytest.fixture()
def trained_lora(tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(tiny_model), LoraConfig(lora_rank=4, lora_alpha=12,
                                                              lora_target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():  # as if trained: B moves off zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def test_only_the_adapter_is_sent_with_B_scaled(trained_lora):
    named = dict(adapter_named_tensors(trained_lora))
    specs = adapter_specs(trained_lora)
    assert [n for n, _, _ in specs] == list(named)
    assert len(named) == 2 * 2 * 2  # 2 layers x (q_proj, down_proj) x (A, B)
    assert all(n.startswith("base_model.model.model.layers.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
               for n in named)
    params = dict(trained_lora.named_parameters())
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(named[b], params[b.replace("lora_B.", "lora_B.default.")] * 3.0)  # 12 / 4
    a = b.replace("lora_B", "lora_A")
    assert torch.equal(named[a], params[a.replace("lora_A.", "lora_A.default.")])


def test_the_adapter_directory_loads_in_peft_as_the_merged_model(trained_lora, tiny_model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config, tensors = adapter_files(adapter_named_tensors(trained_lora), tiny_model)
    assert config["r"] == config["lora_alpha"] == 4 and config["target_modules"] == ["down_proj", "q_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    ids = torch.tensor([[5, 9, 33, 70, 2]])
    merged = AutoModelForCausalLM.from_pretrained(tiny_model)
    merged.load_state_dict(dict(merged_named_weights(trained_lora)), strict=False)
    with torch.no_grad():
        want = merged(ids).logits
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path))(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
    assert (want - base).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_adapter_updates_are_told_apart_and_requests_built():
    assert is_adapter_update(["x.q_proj.lora_A.weight", "x.q_proj.lora_B.weight"])
    assert not is_adapter_update(["model.norm.weight"])
    with pytest.raises(WeightUpdateError, match="mixes LoRA adapter tensors"):
        is_adapter_update(["x.q_proj.lora_A.weight", "model.norm.weight"])
    with pytest.raises(WeightUpdateError, match="not a LoRA adapter tensor"):
        adapter_files([("model.norm.weight", torch.zeros(3))], "base")
    assert lora_request_kwargs(3, 7, "/tmp/a") == {"lora_name": "polyrl-v7", "lora_int_id": 3, "lora_path": "/tmp/a"}
    with pytest.raises(ValueError, match="start at 1"):
        lora_request_kwargs(0, 1, "/tmp/a")


def test_config_and_launch_arguments():
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.platform import get_platform
    from polyrl.rollout.launch_args import vllm_args

    with pytest.raises((ConfigError, ValueError), match="rollout.lora_mode=adapter needs rollout.backend=vllm"):
        load_config(JobConfig, overrides=["rollout.lora_mode=adapter", "model.lora_rank=8"])
    from polyrl.rollout.config import RolloutConfig

    rollout = RolloutConfig(backend="vllm", lora_mode="adapter")
    args = vllm_args(rollout, "/models/base", get_platform("cpu"), colocated=True)
    assert args["enable_lora"] is True and args["load_format"] == "auto"
    assert "enable_lora" not in vllm_args(RolloutConfig(backend="vllm"), "/models/base", get_platform("cpu"),
                                          colocated=True)
