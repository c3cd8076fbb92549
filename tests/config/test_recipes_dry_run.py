"""Every RL recipe under configs/ plans on the hardware its header names: `polyrl train -c FILE
--dry-run --platform h100` exits 0 with no plan errors and asks for the GPUs it was sized for
(docs/recipes.md). The header states the hardware and the accuracy to expect."""

from __future__ import annotations

import json
import re
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
                 "reasoning_gym_arith.yaml", "moe_arith.yaml"}
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


GPU_ENGINES = {"vllm", "sglang", "trtllm"}


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_recipe_generates_with_a_gpu_engine(name, capsys):
    """A GPU recipe names the engine GPU users run (the built-in engine is its documented
    fallback), its header names the extra to install, and the dry run on simulated H100s shows
    that engine's launch arguments on every engine host: on a GPU the engine is built from them."""
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.rollout.launch_args import VLLM_WORKER_EXTENSION

    cfg = load_config(JobConfig, files=[CONFIGS / name])
    backend = cfg.rollout.backend
    assert backend in GPU_ENGINES, f"{name}: rollout.backend={backend}"
    header = "".join(line for line in (CONFIGS / name).read_text().splitlines(keepends=True) if line.startswith("#"))
    assert re.search(rf"polyrl\[[^\]]*\b{backend}\b", header) and "rollout.backend=native" in header, name
    engines = [a["engine"] for a in plan(capsys, name)["actors"] if a.get("engine")]
    assert engines, name
    for engine in engines:
        assert engine["backend"] == backend and not engine.get("error"), engine
        args = engine["args"]
        assert args["model"] == cfg.model.path and args["dtype"] == cfg.rollout.dtype
        assert args["tensor_parallel_size"] == cfg.rollout.tensor_parallel_size
        if backend == "vllm":  # hybrid: the engine sleeps while the policy trains, weights arrive in place
            assert args["worker_extension_cls"] == VLLM_WORKER_EXTENSION and args["enable_sleep_mode"] is True
            assert args["gpu_memory_utilization"] == cfg.rollout.gpu_memory_utilization


@pytest.mark.parametrize("name", ["grpo_gsm8k_qwen2.5_0.5b_1gpu.yaml", "tools_gsm8k_qwen2.5_3b_8gpu.yaml"])
def test_the_builtin_engine_fallback_plans(name, capsys):
    code = main(["train", "-c", str(CONFIGS / name), "--dry-run", "--platform", "h100", "--json",
                 "rollout.backend=native"])
    out = capsys.readouterr()
    assert code == 0, out.err
    p = json.loads(out.out)
    assert p["errors"] == [] and {a["engine"]["backend"] for a in p["actors"] if a.get("engine")} == {"native"}
