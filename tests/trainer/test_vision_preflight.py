"""Pre-flight of a vision-language model (polyrl/trainer/preflight.py `check_vision`): the settings
its image forward does not take yet are refused in one line naming the key, before Ray starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tiny_vl import tiny_vl_config

from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.trainer.preflight import check_vision

TEXT_ROW = SimpleNamespace(prompt_ids=[1, 2], images=None)
IMAGE_ROW = SimpleNamespace(prompt_ids=[1, 2], images=object())


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=list(overrides))


@pytest.fixture(scope="module")
def vl_config():
    return tiny_vl_config()


def test_a_supported_vlm_with_default_settings_passes(vl_config):
    check_vision(job(), [IMAGE_ROW], None, vl_config)


@pytest.mark.parametrize("override,key", [
    ("actor.sequence_parallel_size=2", "actor.sequence_parallel_size"),
    ("rollout.batch_invariant=true", "rollout.batch_invariant"),
    ("critic.enable=true", "critic.enable"),
])
def test_settings_the_image_forward_lacks_are_refused_naming_the_key(vl_config, override, key):
    overrides = [override] + (["actor.world_size=2"] if "sequence" in override else []) \
        + (["algorithm.adv_estimator=gae"] if "critic" in override else [])
    with pytest.raises(ConfigError) as err:
        check_vision(job(*overrides), [TEXT_ROW], None, vl_config)
    (line,) = err.value.problems
    assert line.startswith(key) and "vision-language" in line


def test_async_and_agents_with_image_rows_are_refused_text_rows_are_not(vl_config):
    with pytest.raises(ConfigError, match="trainer.mode=async"):
        check_vision(job("trainer.mode=async", "rollout.placement=standalone"), [TEXT_ROW], [IMAGE_ROW], vl_config)
    check_vision(job("trainer.mode=async", "rollout.placement=standalone"), [TEXT_ROW], None, vl_config)


def test_an_unsupported_vlm_type_is_named(vl_config):
    other = SimpleNamespace(model_type="llava", vision_config={"x": 1})
    with pytest.raises(ConfigError, match="a llava vision-language model"):
        check_vision(job(), [IMAGE_ROW], None, other)


def test_a_text_model_is_not_checked():
    check_vision(job("actor.sequence_parallel_size=2", "actor.world_size=2"), [TEXT_ROW], None,
                 SimpleNamespace(model_type="qwen2"))


def test_image_rows_on_an_engine_without_images_are_refused(vl_config):
    with pytest.raises(ConfigError, match="rollout.backend=sglang: the engine declares no images"):
        check_vision(job("rollout.backend=sglang"), [IMAGE_ROW], None, vl_config)
    check_vision(job("rollout.backend=sglang"), [TEXT_ROW], None, vl_config)  # text rows: any engine
