"""Every RL recipe under configs/ plans on the hardware its header names: `polyrl train -c FILE
--dry-run --platform h100` exits 0 with no plan errors and asks for the GPUs it was sized for
(docs/recipes.md). The header states the hardware and the accuracy to expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.cli.main import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

GPUS = {  # recipe -> H100s it was sized for (one node each)
    "grpo_gsm8k_qwen2.5_0.5b_1gpu.yaml": 1,
    "grpo_gsm8k_qwen2.5_0.5b_8gpu.yaml": 8,
    "grpo_gsm8k_qwen2.5_1.5b_1gpu.yaml": 1,
    "grpo_gsm8k_qwen2.5_1.5b_8gpu.yaml": 8,
    "grpo_gsm8k_qwen2.5_7b_1gpu.yaml": 1,
    "grpo_gsm8k_qwen2.5_7b_8gpu.yaml": 8,
    "grpo_lora_gsm8k_qwen2.5_3b_1gpu.yaml": 1,
    "ppo_gae_gsm8k_qwen2.5_0.5b_1gpu.yaml": 1,
    "gspo_gsm8k_qwen2.5_1.5b_8gpu.yaml": 8,
    "dapo_math_qwen2.5_math_7b_8gpu.yaml": 8,
    "tools_gsm8k_qwen2.5_3b_8gpu.yaml": 8,
    "gsm8k_qwen_gpu.yaml": 8,
    "reasoning_gym_qwen2.5_1.5b_1gpu.yaml": 1,
}
# the bundled model and data, any machine
EMBEDDED_TASK = {"dapo_arith.yaml", "tools_calculator.yaml", "distill_arith.yaml", "vision_shapes.yaml",
                 "reasoning_gym_arith.yaml"}
SFT = {"sft_chat_qwen_gpu.yaml"}  # `polyrl sft` configs, not `polyrl train`


def plan(capsys, name: str) -> dict:
    code = main(["train", "-c", str(CONFIGS / name), "--dry-run", "--platform", "h100", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_every_config_is_a_known_recipe():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert names - GPUS.keys() - EMBEDDED_TASK - SFT == set(), "add the new recipe to this test"


@pytest.mark.parametrize("name", sorted(GPUS))
def test_recipe_plans_on_the_gpus_it_was_sized_for(name, capsys):
    p = plan(capsys, name)
    assert p["errors"] == []
    assert p["devices"]["needed"] == GPUS[name] and p["devices"]["nodes"] == 1, p["devices"]
    assert len(p["actors"]) == GPUS[name]  # one policy rank per GPU, its engine colocated


@pytest.mark.parametrize("name", sorted(EMBEDDED_TASK))
def test_embedded_task_recipe_plans_on_h100(name, capsys):
    assert plan(capsys, name)["errors"] == []


@pytest.mark.parametrize("name", sorted(set(GPUS) - {"gsm8k_qwen_gpu.yaml"}))
def test_recipe_header_names_hardware_and_expected_accuracy(name):
    header = "".join(line for line in (CONFIGS / name).read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    assert "Sized for: " in header and "H100" in header, name
    assert "Expect" in header, name
    assert f"polyrl train -c configs/{name} --dry-run --platform h100" in header, name
