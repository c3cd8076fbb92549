"""DAPO's pieces by hand: soft overlong punishment, overlong filtering, dynamic sampling's group
selection, their config checks, and the recipe config."""

from pathlib import Path

import pytest
import torch

from polyrl.algorithms import (
    AlgorithmConfig,
    check_critic,
    check_rollout,
    check_samples_per_prompt,
    informative_groups,
    overlong_filter_mask,
    overlong_penalty,
    select_informative,
)
from polyrl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def test_soft_overlong_punishment():
    # L_max 10, L_buf 4: free up to 6, then (6 - L) / 4 down to -1 at 10, -1 beyond
    lengths = torch.tensor([0, 3, 6, 7, 8, 9, 10, 12])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=10, buffer_length=4), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5), expected * 0.5)


@pytest.mark.parametrize("buffer", [0, 10, 11])
def test_overlong_buffer_must_fit_the_limit(buffer):
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([5]), max_length=10, buffer_length=buffer)


def test_overlong_filter_masks_whole_truncated_rows_only():
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # holes stay holes
    out = overlong_filter_mask(torch.tensor([False, True, False]), mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert overlong_filter_mask(torch.tensor([True]), torch.ones(1, 2, dtype=torch.bool)).dtype == torch.bool


# groups by first appearance: 7 (differ), 3 (tied), 9 (differ), 4 (alone), 5 (differ)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.3])
GROUPS = torch.tensor([7, 3, 7, 9, 3, 9, 9, 4, 5, 5])


def test_informative_groups():
    assert informative_groups(REWARDS, GROUPS).tolist() == [
        True, False, True, True, False, True, True, False, True, True]


@pytest.mark.parametrize("needed,kept,count", [
    (1, [7], 1),  # the first informative group to appear, not the lowest id
    (2, [7, 9], 2),
    (3, [7, 9, 5], 3),
    (5, [7, 9, 5], 3),  # short: only three differ
    (0, [], 0),
])
def test_select_informative_takes_whole_groups_in_arrival_order(needed, kept, count):
    keep, taken = select_informative(REWARDS, GROUPS, needed)
    assert taken == count
    assert keep.tolist() == [g in kept for g in GROUPS.tolist()]


def test_select_informative_empty_round():
    keep, taken = select_informative(torch.zeros(0), torch.zeros(0, dtype=torch.long), 4)
    assert taken == 0 and keep.numel() == 0


@pytest.mark.parametrize("key", ["dynamic_sampling", "filter_tied_groups"])
def test_dropping_tied_groups_needs_two_samples(key):
    cfg = AlgorithmConfig(**{key: True})
    with pytest.raises(ValueError, match=rf"algorithm.{key}=true .* set rollout.n="):
        check_samples_per_prompt(cfg, 1)
    check_samples_per_prompt(cfg, 2)


@pytest.mark.parametrize("key", ["dynamic_sampling", "filter_tied_groups"])
def test_tied_group_dropping_rejected_with_a_critic(key):
    with pytest.raises(ValueError, match=rf"set algorithm.{key}=false"):
        AlgorithmConfig(adv_estimator="gae", **{key: True})


def test_overlong_config_checks():
    with pytest.raises(ConfigError, match="set algorithm.overlong.buffer_length"):
        load_config(AlgorithmConfig, overrides=["overlong.shaping=true"])
    cfg = AlgorithmConfig(overlong={"shaping": True, "buffer_length": 512})
    with pytest.raises(ValueError, match=r"buffer_length=512 must be below rollout.response_length=512.*"
                                         r"buffer_length=102"):
        check_rollout(cfg, n=8, response_length=512)
    check_rollout(cfg, n=8, response_length=2048)
    with pytest.raises(ConfigError, match="max_sampling_rounds"):
        load_config(AlgorithmConfig, overrides=["max_sampling_rounds=0"])


def test_critic_only_with_gae():
    with pytest.raises(ValueError, match="set algorithm.adv_estimator=gae or remove the critic"):
        check_critic(AlgorithmConfig(), has_critic=True)
    with pytest.raises(ValueError, match="needs a critic's values; add a critic section"):
        check_critic(AlgorithmConfig(adv_estimator="gae"), has_critic=False)
    check_critic(AlgorithmConfig(adv_estimator="gae"), has_critic=True)
    check_critic(AlgorithmConfig(), has_critic=False)


def test_dapo_recipe_loads_with_its_settings():
    from polyrl.job import JobConfig

    cfg = load_config(JobConfig, files=[REPO / "configs" / "dapo_arith.yaml"])
    algo = cfg.algorithm
    assert (algo.clip_ratio_low, algo.clip_ratio_high) == (0.2, 0.28)
    assert algo.loss_agg_mode == "token-mean" and not algo.uses_reference
    assert algo.dynamic_sampling and algo.max_sampling_rounds >= 1
    assert algo.overlong.shaping and algo.overlong.buffer_length == 2
    check_rollout(algo, n=cfg.rollout.n, response_length=cfg.rollout.response_length)
    # on this task the ramp spares every correct answer (at most 3 digits + EOS)
    assert overlong_penalty(torch.tensor([4]), cfg.rollout.response_length, 2).item() == 0.0
