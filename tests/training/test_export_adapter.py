"""`polyrl export --adapter-only`: a LoRA checkpoint's adapter as a peft directory that
`PeftModel.from_pretrained(base, DIR)` loads, computing the logits of the merged export; a
checkpoint without an adapter is an error naming the flag."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from polyrl.cli.main import main


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.lora import LoraConfig, apply_lora
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.workers.actor import PPOActor
    from polyrl.training.model_loading import load_causal_lm

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    cfg = engine_ranks.actor_config("ddp", lr=1e-2)
    model = apply_lora(load_causal_lm(tiny_model), LoraConfig(lora_rank=4))
    engine = build_engine(model, cfg, platform, device, horizon=8)
    PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device).update(
        engine_ranks.make_batch(1), 1, False)
    ckpt = tmp_path_factory.mktemp("lora") / "step_000001"
    ckpt.mkdir()
    engine.save(ckpt)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(str(ckpt / "policy"))
    return ckpt


def test_adapter_only_loads_in_peft_with_the_merged_exports_logits(lora_checkpoint, tiny_model, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(lora_checkpoint), "--output", str(adapter), "--adapter-only"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert main(["export", str(lora_checkpoint), "--output", str(merged)]) == 0
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                                str(adapter))(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(str(merged))(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-4  # the adapter trained: not the base model
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)


def test_adapter_only_casts(lora_checkpoint, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    assert main(["export", str(lora_checkpoint), "-o", str(out), "--adapter-only", "--dtype", "bfloat16"]) == 0
    assert {t.dtype for t in load_file(str(out / "adapter_model.safetensors")).values()} == {torch.bfloat16}


def test_adapter_only_of_a_full_checkpoint_names_the_flag(tiny_model, tmp_path, capsys):
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    engine, _ = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1)
    engine.save(ckpt)
    assert main(["export", str(ckpt), "-o", str(tmp_path / "out"), "--adapter-only"]) == 2
    err = capsys.readouterr().err
    assert "--adapter-only" in err and "model.lora_rank > 0" in err and "Drop --adapter-only" in err
    assert not (tmp_path / "out").exists()
