"""AlgorithmConfig rejects combinations that cannot run, naming the field and the fix."""

import pytest

from polyrl.algorithms import AlgorithmConfig, check_samples_per_prompt
from polyrl.config import ConfigError, load_config


def test_defaults_are_valid():
    cfg = AlgorithmConfig()
    assert cfg.adv_estimator == "grpo" and not cfg.uses_reference


def test_kl_twice_rejected():
    with pytest.raises(ValueError, match="use_kl_loss=false"):
        AlgorithmConfig(use_kl_in_reward=True, use_kl_loss=True)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match="dual_clip_c"):
        AlgorithmConfig(dual_clip_c=c)


def test_unknown_estimator_lists_choices():
    with pytest.raises(ConfigError, match="adv_estimator: 'ppo' is not one of grpo, rloo, reinforce_pp, gae, "
                                          "or package.module:name or /path/to/file.py:name"):
        load_config(AlgorithmConfig, overrides=["adv_estimator=ppo"])


def test_unknown_policy_loss_lists_choices():
    with pytest.raises(ConfigError, match="policy_loss: 'nope' is not one of ppo_clip, gspo, gspo_token, "
                                          "or package.module:name"):
        load_config(AlgorithmConfig, overrides=["policy_loss=nope"])


def test_negative_kl_coef_rejected():
    with pytest.raises(ConfigError, match="kl_coef"):
        load_config(AlgorithmConfig, overrides=["kl_coef=-0.1"])


@pytest.mark.parametrize("est", ["grpo", "rloo", "reinforce_pp"])
def test_group_estimators_need_two_samples(est):
    cfg = AlgorithmConfig(adv_estimator=est)
    with pytest.raises(ValueError, match=r"needs rollout.n >= 2 .* set rollout.n="):
        check_samples_per_prompt(cfg, 1)
    check_samples_per_prompt(cfg, 2)


def test_uses_reference():
    assert AlgorithmConfig(use_kl_loss=True, kl_coef=0.01).uses_reference
    assert not AlgorithmConfig(use_kl_loss=True, kl_coef=0.0).uses_reference
