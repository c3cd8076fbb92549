"""Config loading: YAML + dotted overrides, and the messages users see for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl.config import ConfigError, describe, load_config, parse_overrides, to_yaml
from polyrl.job import JobConfig

REPO = Path(__file__).resolve().parents[2]


def errors(*overrides, files=()):
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, files=files, overrides=overrides)
    return info.value.problems


def test_overrides_parse_yaml_scalars():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]", "e=true", "f=1e-3"]) == {
        "a": {"b": 1, "c": "x"}, "d": [1, 2], "e": True, "f": "1e-3"}


def test_files_then_overrides(tmp_path):
    f1 = tmp_path / "a.yaml"
    f1.write_text("rollout:\n  n: 4\n  temperature: 0.7\nactor:\n  lr: 0.01\n")
    f2 = tmp_path / "b.yaml"
    f2.write_text("rollout:\n  n: 6\n")
    cfg = load_config(JobConfig, files=[f1, f2], overrides=["actor.lr=1e-4"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.actor.lr) == (6, 0.7, 1e-4)


def test_choice_error_names_key_value_and_choices():
    assert errors("rollout.backend=vlm") == [
        "rollout.backend: 'vlm' is not one of native, vllm, sglang, trtllm"]


def test_unknown_key_suggests():
    assert errors("rollout.bakend=vllm") == ["rollout.bakend: unknown key; did you mean 'rollout.backend'?"]
    assert errors("rolout.n=2") == ["rolout: unknown key; did you mean 'rollout'?"]
    (msg,) = errors("rollout.zzz=1")
    assert msg.startswith("rollout.zzz: unknown key (valid keys: backend, placement, n,")


def test_range_and_type_errors():
    assert errors("rollout.n=0") == ["rollout.n: 0 is invalid: input should be greater than or equal to 1"]
    (msg,) = errors("actor.lr=abc")
    assert msg.startswith("actor.lr: 'abc' is invalid")
    assert len(errors("rollout.n=0", "rollout.top_p=2")) == 2  # every problem at once


def test_cross_field_error_names_the_fix():
    (msg,) = errors("rollout.num_replicas=2")
    assert "rollout.placement=disaggregated" in msg


def test_bad_files(tmp_path):
    assert errors(files=[tmp_path / "missing.yaml"]) == [f"config file {tmp_path / 'missing.yaml'} does not exist"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    assert "is not valid YAML" in errors(files=[bad])[0]
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        load_config(JobConfig, overrides=["rollout.n"])


def test_every_field_is_documented():
    undocumented = [key for key, _, _, doc in describe(JobConfig) if not doc.strip()]
    assert not undocumented


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(JobConfig, overrides=["rollout.n=3", "env.A=1"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(JobConfig, files=[path]) == cfg


SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "polyrl" / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    assert {p.name for p in SHIPPED} >= {"gsm8k_qwen_gpu.yaml", "embedded_default.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    from polyrl.sft.config import SFTConfig

    # sft_*.yaml are `polyrl sft` configs; every other one is a `polyrl train` job
    load_config(SFTConfig if path.name.startswith("sft_") else JobConfig, files=[path])


def test_aliased_section_is_written_and_suggested_by_its_key():
    # the `async` section is the field `async_` (a Python keyword): users only ever see `async`
    keys = [row[0] for row in describe(JobConfig)]
    assert "async.max_staleness" in keys and not any(k.startswith("async_") for k in keys)
    assert errors("async.max_stalenes=2") == [
        "async.max_stalenes: unknown key; did you mean 'async.max_staleness'?"]
    assert load_config(JobConfig, overrides=["async.max_staleness=3"]).async_.max_staleness == 3
