"""LoRA on peft (polyrl/training/lora.py) with a tiny Qwen2 built in a temp dir: what trains,
merged weights by hand, the reference policy with adapters off, checkpoints, exports, errors."""

from __future__ import annotations

import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.training.lora import (
    LoraConfig,
    LoraError,
    adapter_parameters,
    adapters_disabled,
    apply_lora,
    export,
    load_adapter,
    merged_named_weights,
    save_adapter,
)


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora-base"))


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


IDS = torch.tensor([[5, 17, 33, 2, 9, 41, 60, 7], [12, 3, 3, 90, 4, 44, 8, 1]])


def logprobs(model):
    logits = model(input_ids=IDS).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, IDS[:, 1:, None])[..., 0]


def trained(path, cfg, steps=3):
    """A LoRA model after a few AdamW steps on a next-token loss (so B != 0), and its optimizer."""
    torch.manual_seed(0)
    model = apply_lora(load(path), cfg)
    opt = torch.optim.AdamW(adapter_parameters(model), lr=1e-2)
    for _ in range(steps):
        loss = -logprobs(model).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), opt


def test_only_adapters_train_and_hold_optimizer_state(base_path):
    model, opt = trained(base_path, LoraConfig(lora_rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 linear layers (q k v o gate up down; lm_head is tied and left out) x (A, B)
    assert len(trainable) == 2 * 7 * 2
    state = [s for s in opt.state.values()]
    adapter_numel = sum(p.numel() for p in adapter_parameters(model))
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state) == 2 * adapter_numel
    base = dict(load(base_path).named_parameters())
    for name, p in model.get_base_model().named_parameters():  # the base weights did not move
        if ".lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


def test_merged_weights_equal_base_plus_scaled_BA(base_path):
    cfg = LoraConfig(lora_rank=4, lora_alpha=12, lora_target_modules=["q_proj", "down_proj"])
    model, _ = trained(base_path, cfg)
    merged = dict(merged_named_weights(model))
    base = dict(load(base_path).named_parameters())
    assert set(merged) == set(base)  # Hugging Face names, tied embedding once, no lora tensors
    inner = model.get_base_model()
    changed = 0
    for name, weight in merged.items():
        owner = name.rpartition(".")[0]
        module = inner.get_submodule(owner)
        if name.endswith(".weight") and hasattr(module, "lora_A"):
            A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
            expected = base[name] + (B @ A) * (12 / 4)
            assert torch.allclose(weight, expected, atol=1e-6), name
            assert not torch.allclose(weight, base[name])  # training moved B off zero
            changed += 1
        else:
            assert torch.equal(weight, base[name]), name
    assert changed == 2 * 2  # q_proj and down_proj in both layers
    # a plain model given the merged weights computes what the LoRA model computes
    plain = load(base_path)
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        assert torch.allclose(logprobs(plain), logprobs(model), atol=1e-5)


def test_reference_logprobs_with_adapters_disabled_equal_the_base_model(base_path):
    model, _ = trained(base_path, LoraConfig(lora_rank=8))
    with torch.no_grad():
        expected = logprobs(load(base_path))
        tuned = logprobs(model)
        with adapters_disabled(model) as reference:
            ref = logprobs(reference)
        after = logprobs(model)
    assert torch.allclose(ref, expected, atol=1e-6)
    assert not torch.allclose(tuned, expected, atol=1e-3)  # the adapters matter...
    assert torch.equal(after, tuned)  # ...and are back on after the block


def test_adapter_checkpoint_round_trip(base_path, tmp_path):
    cfg = LoraConfig(lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    model, _ = trained(base_path, cfg)
    save_adapter(model, tmp_path / "ckpt")
    fresh = apply_lora(load(base_path), cfg)
    load_adapter(fresh, tmp_path / "ckpt")
    want = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    with torch.no_grad():
        assert torch.equal(logprobs(fresh.eval()), logprobs(model))
    other = apply_lora(load(base_path), LoraConfig(lora_rank=2, lora_target_modules=["q_proj", "v_proj"]))
    with pytest.raises(LoraError, match="rank-4 adapter .* this run has rank 2"):
        load_adapter(other, tmp_path / "ckpt")
    with pytest.raises(LoraError, match="holds no adapter_model.safetensors"):
        load_adapter(fresh, tmp_path)


def test_export_merged_loads_without_peft_and_adapter_only(base_path, tmp_path):
    from tiny_models import char_tokenizer

    model, _ = trained(base_path, LoraConfig(lora_rank=4))
    export(model, tmp_path / "merged", tokenizer=char_tokenizer())
    plain = load(tmp_path / "merged")
    assert not any("lora" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        assert torch.allclose(logprobs(plain), logprobs(model), atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    export(model, tmp_path / "adapter", adapter_only=True)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_bad_target_modules_and_rank_name_the_key(base_path):
    with pytest.raises(LoraError, match=r"model.lora_target_modules: 'qproj' matches no linear layer.*"
                                        r"named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        apply_lora(load(base_path), LoraConfig(lora_rank=4, lora_target_modules=["q_proj", "qproj"]))
    # hidden 64, k/v project to 2 heads x 16 = 32: rank 48 fits q_proj (64x64) but not k_proj
    with pytest.raises(LoraError, match=r"model.lora_rank=48 is larger than layer\(s\) k_proj \(64x32\), "
                                        r"v_proj \(64x32\) .*; lower model.lora_rank"):
        apply_lora(load(base_path), LoraConfig(lora_rank=48))
    apply_lora(load(base_path), LoraConfig(lora_rank=48, lora_target_modules=["q_proj"]))  # fits
    with pytest.raises(ConfigError, match=r"lora_dropout"):
        load_config(LoraConfig, overrides=["lora_dropout=1.5"])
    with pytest.raises(ConfigError, match=r"lora_target_modules"):
        load_config(LoraConfig, overrides=["lora_target_modules=everything"])
    with pytest.raises(LoraError, match="adapters_disabled needs a model from apply_lora"):
        with adapters_disabled(load(base_path)):
            pass


def test_defaults():
    cfg = load_config(LoraConfig, overrides=["lora_rank=8"])
    assert cfg.enabled and cfg.alpha == 16.0 and cfg.lora_target_modules == "all-linear"
    assert not LoraConfig().enabled
