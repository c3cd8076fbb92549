"""A vision-language checkpoint keeps its image processor: an RL checkpoint's policy/ (full or LoRA)
carries preprocessor_config.json, `polyrl export` copies it (falling back to model.path for
checkpoints written without it), and the export then takes images the way the base model does."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from polyrl.builtin import resolve
from polyrl.cli.main import main
from polyrl.config import load_config
from polyrl.data.vision import VisionPrompter
from polyrl.job import JobConfig
from polyrl.topology.launch_plan import role_plans
from polyrl.workers.policy import PolicyWorker
from tiny_vl import shape_image

BASE = Path(resolve("builtin:tiny-vl"))


def checkpoint(tmp_path, *overrides: str):
    """The checkpoint of an in-process policy worker on builtin:tiny-vl (no Ray), with the
    config.yaml the trainer writes beside it."""
    cfg = load_config(JobConfig, overrides=["model.path=builtin:tiny-vl", "rollout.max_model_len=128",
                                            *overrides])
    [role] = role_plans(cfg, num_threads=1)["policy"]
    worker = PolicyWorker(cfg, role, total_steps=1)
    worker.setup(None)
    step = tmp_path / "step_000001"
    step.mkdir()
    worker.save_checkpoint(str(step))
    (step / "config.yaml").write_text(yaml.safe_dump({"model": {"path": "builtin:tiny-vl"}}))
    return step


def assert_takes_images_like_the_base(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    exported = VisionPrompter.from_model_dir(model_dir, tokenizer)
    base = VisionPrompter.from_model_dir(BASE, AutoTokenizer.from_pretrained(str(BASE)))
    image = shape_image("red", side=84)
    got, want = exported.process([image]), base.process([image])
    assert got.image_grid_thw.tolist() == want.image_grid_thw.tolist()
    assert got.pixel_values.equal(want.pixel_values)


@pytest.mark.slow  # two policy workers built in-process (~20 s on 2 busy cores)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rl_checkpoint_and_its_export_keep_the_image_processor(tmp_path, lora, capsys):
    step = checkpoint(tmp_path, *(["model.lora_rank=4"] if lora else []))
    processor = (BASE / "preprocessor_config.json").read_bytes()
    assert (step / "policy" / "preprocessor_config.json").read_bytes() == processor
    out = tmp_path / "exported"
    assert main(["export", str(step), "--output", str(out)]) == 0
    assert (out / "preprocessor_config.json").read_bytes() == processor
    assert_takes_images_like_the_base(out)
    if lora:
        return
    # a checkpoint written before policy/ carried the file: export takes model.path's
    (step / "policy" / "preprocessor_config.json").unlink()
    assert main(["export", str(step), "--output", str(tmp_path / "old")]) == 0
    assert_takes_images_like_the_base(tmp_path / "old")
    # neither has it: the export warns, naming the file
    (step / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(step / "policy")}}))
    assert main(["export", str(step), "--output", str(tmp_path / "bare")]) == 0
    assert "preprocessor_config.json" in capsys.readouterr().err
