"""`polyrl sft` with `model.lora_rank`: adapters train on the targeted layers only, checkpoints
carry `policy_adapter/` as RL checkpoints do (so `polyrl export` works on them), resume loads the
adapter, and LoRA settings that cannot apply are one line and exit 2 before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from polyrl.cli.main import main
from polyrl.config import load_config
from polyrl.sft.config import SFTConfig
from polyrl.sft.trainer import SFTTrainer

LORA = ("model.lora_rank=4", "model.lora_target_modules=[q_proj,v_proj]")


def config(out, *overrides) -> SFTConfig:
    return load_config(SFTConfig, overrides=[
        "data.max_samples=64", "data.train_batch_size=16", "data.val_files=[]",
        "trainer.progress_bar=false", "logging.plot_at_end=false", f"trainer.output_dir={out}",
        *overrides])


def base_weights() -> dict[str, torch.Tensor]:
    from polyrl.builtin import resolve

    return load_file(f"{resolve('builtin:tiny-arith')}/model.safetensors")


def test_lora_sft_trains_only_the_adapters_and_writes_policy_adapter(tmp_path):
    SFTTrainer(config(tmp_path / "run", *LORA, "trainer.total_steps=2")).fit()
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    adapter = step / "policy_adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    merged, base = load_file(str(step / "policy" / "model.safetensors")), base_weights()
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    # the adapted layers moved (B left zero), everything else is the frozen base
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed

    out = tmp_path / "exported"
    assert main(["export", str(step), "-o", str(out), "--adapter-only"]) == 0
    assert (out / "adapter_model.safetensors").is_file()
    assert main(["export", str(step), "-o", str(tmp_path / "merged")]) == 0

    # resume from the LoRA checkpoint: the adapter comes back, training continues
    resumed = SFTTrainer(config(tmp_path / "run", *LORA, "trainer.total_steps=3"))
    summary = resumed.fit()
    assert summary["steps"] == 3 and (tmp_path / "run/checkpoints/step_000003/policy_adapter").is_dir()


@pytest.mark.parametrize("overrides, message", [
    (("model.lora_rank=4", "model.lora_target_modules=[nope_proj]"),
     "model.lora_target_modules: 'nope_proj' matches no linear layer of this model"),
    (("model.lora_rank=100",), "model.lora_rank=100 is larger than layer(s)"),
    (("model.lora_rank=4", "model.lora_target_modules=[]"),
     "model.lora_target_modules: no linear layer to adapt"),
])
def test_bad_lora_settings_are_one_line_exit_2_before_training(capsys, tmp_path, overrides, message):
    out = tmp_path / "run"
    assert main(["sft", *overrides, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()  # refused before the run wrote anything
    assert main(["sft", *overrides, "--dry-run", "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
