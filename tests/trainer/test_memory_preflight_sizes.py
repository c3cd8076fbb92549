"""A config.json whose sizes are not positive integers (0 heads, -1 layers, "4096") is one line
naming the key, from the memory pre-flight and from `polyrl train --dry-run`, instead of a
ZeroDivisionError or a dry run that passes."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main
from polyrl.training import memory_floor as mf
from polyrl.training import memory_plan as mp

QWEN25_7B = {**mp.QWEN25["Qwen2.5-7B"], "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 0), ("num_hidden_layers", -1), ("hidden_size", "4096"),
    ("num_key_value_heads", 0), ("intermediate_size", -11008), ("vocab_size", True),
])
def test_bad_sizes_are_one_line_naming_the_key(tmp_path, capsys, key, value):
    with pytest.raises(ValueError, match=f"config.json has {key}="):
        mf.model_shape({**QWEN25_7B, key: value})
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_7B, key: value}))
    code = main(["train", "--dry-run", "--platform", "h100", f"model.path={tmp_path}",
                 "actor.strategy=fsdp2", "rollout.placement=standalone"])
    err = capsys.readouterr().err
    assert code == 2 and f"model.path: {tmp_path}'s config.json has {key}=" in err, err[-2000:]
    assert "Traceback" not in err


def test_good_sizes_still_plan():
    assert mf.model_shape(QWEN25_7B).params > 7e9


def test_a_colocated_teacher_counts_in_the_policy_ranks_memory(tmp_path):
    """Qwen2.5-7B on 4 fsdp2 H100 ranks fits alone (20 bytes a parameter / 4), not beside a
    colocated 72B teacher's fp32 shards; a standalone teacher is not on those ranks."""
    from polyrl.cli.common import choose_platform
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_memory

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({**mp.QWEN25["Qwen2.5-72B"], "model_type": "qwen2",
                                                     "architectures": ["Qwen2ForCausalLM"]}))
    run = ["actor.strategy=fsdp2", "actor.world_size=4", "rollout.placement=standalone"]
    h100 = choose_platform("h100")
    check_memory(load_config(JobConfig, overrides=run), QWEN25_7B, h100)
    with pytest.raises(ConfigError) as info:
        check_memory(load_config(JobConfig, overrides=[*run, f"distill.teacher={teacher}"]), QWEN25_7B, h100)
    assert "teacher 67.7" in info.value.problems[0], info.value.problems[0]  # 4 bytes x 72.7B / 4, in GiB
    standalone = [*run, f"distill.teacher={teacher}", "distill.placement=standalone", "distill.world_size=4"]
    check_memory(load_config(JobConfig, overrides=standalone), QWEN25_7B, h100)
