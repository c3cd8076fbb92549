"""On-policy distillation's advantage math (polyrl/algorithms/distill.py), its config
(polyrl/algorithms/distill_config.py) and the teacher tokenizer check."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from polyrl.algorithms.distill import (
    check_teacher_tokenizer,
    distill_advantages,
    distill_token_rewards,
    reverse_kl,
)
from polyrl.algorithms.distill_config import DistillConfig
from polyrl.job import JobConfig

STUDENT = torch.tensor([[-0.5, -1.0, -2.0, 0.0],
                        [-0.1, -3.0, -0.2, -0.4]])
TEACHER = torch.tensor([[-0.2, -1.5, -0.5, 0.0],
                        [-0.1, -0.1, -0.3, -2.0]])
# row 0: 3 response tokens (the 4th is padding); row 1: a multi-turn sample whose tokens 1 and 2
# are tool output (in the sequence, not sampled by the student)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 0.0, 0.0, 1.0]])


def test_token_reward_is_the_negative_log_ratio_times_coef_on_sampled_tokens():
    r = distill_token_rewards(STUDENT, TEACHER, MASK, coef=2.0)
    # student - teacher: row 0 (-0.3, 0.5, -1.5), row 1's last token 1.6
    expected = torch.tensor([[0.6, -1.0, 3.0, 0.0],
                             [0.0, 0.0, 0.0, -3.2]])
    torch.testing.assert_close(r, expected)


def test_tokens_off_the_loss_mask_carry_no_distillation_term():
    # the tool-output tokens of row 1 have a large student-teacher gap: it must not leak in
    adv, _ = distill_advantages(torch.ones(2, 4), STUDENT, TEACHER, MASK, coef=1.0, reward_weight=1.0)
    assert adv[1, 1] == 0 and adv[1, 2] == 0 and adv[0, 3] == 0


def test_combination_adds_distillation_to_the_weighted_outcome_advantages():
    outcome = torch.tensor([[0.5, 0.5, 0.5, 0.0],
                            [-1.0, -1.0, -1.0, -1.0]])
    adv, _ = distill_advantages(outcome, STUDENT, TEACHER, MASK, coef=1.0, reward_weight=0.5)
    expected = (0.5 * outcome - (STUDENT - TEACHER)) * MASK
    torch.testing.assert_close(adv, expected)


def test_reward_weight_zero_is_pure_distillation():
    token = distill_token_rewards(STUDENT, TEACHER, MASK, coef=1.0)
    for outcome in (torch.zeros(2, 4), torch.randn(2, 4)):
        adv, _ = distill_advantages(outcome, STUDENT, TEACHER, MASK, coef=1.0, reward_weight=0.0)
        torch.testing.assert_close(adv, token)


def test_reverse_kl_is_the_mean_log_ratio_over_loss_tokens():
    # row 0: -0.3 + 0.5 - 1.5; row 1: 0 + 1.6 (tool tokens and padding ignored) -> 0.3 / 5
    assert reverse_kl(STUDENT, TEACHER, MASK) == pytest.approx(0.3 / 5)
    _, metrics = distill_advantages(torch.zeros(2, 4), STUDENT, TEACHER, MASK, coef=3.0, reward_weight=1.0)
    assert metrics["distill/reverse_kl"] == pytest.approx(0.3 / 5)
    assert metrics["distill/token_reward_mean"] == pytest.approx(-3.0 * 0.3 / 5)


def test_identical_teacher_gives_the_estimator_alone():
    outcome = torch.randn(2, 4)
    adv, metrics = distill_advantages(outcome, STUDENT, STUDENT, MASK, coef=1.0, reward_weight=1.0)
    torch.testing.assert_close(adv, outcome * MASK)
    assert metrics["distill/reverse_kl"] == 0


def test_config_defaults_and_errors():
    cfg = JobConfig()
    assert not cfg.distill.enabled and cfg.distill.coef == 1.0 and cfg.distill.reward_weight == 1.0
    assert DistillConfig(teacher="/some/dir", reward_weight=0).enabled
    own = DistillConfig(teacher="/t", placement="disaggregated", world_size=2, strategy="fsdp2")
    assert own.own_ranks == 2 and DistillConfig(teacher="/t").own_ranks == 0
    assert DistillConfig(placement="disaggregated").own_ranks == 0  # no teacher: no ranks
    with pytest.raises(ValidationError, match="distill.world_size sizes a teacher on ranks of its own"):
        DistillConfig(teacher="/t", world_size=2)  # colocated: the policy ranks shard it
    with pytest.raises(ValidationError, match="distill.strategy sizes a teacher on ranks of its own"):
        DistillConfig(teacher="/t", strategy="fsdp2")
    with pytest.raises(ValidationError, match="leave nothing to learn"):
        DistillConfig(teacher="/t", coef=0, reward_weight=0)
    with pytest.raises(ValidationError):
        DistillConfig(coef=-1)


def test_teacher_tokenizer_check(tiny_model, tmp_path):
    check_teacher_tokenizer(tiny_model, tiny_model)  # the same tokenizer: fine
    check_teacher_tokenizer("builtin:tiny-arith", "builtin:tiny-arith")
    with pytest.raises(ValueError) as err:
        check_teacher_tokenizer("builtin:tiny-arith", tiny_model)
    line = str(err.value)
    assert "\n" not in line and line.startswith("distill.teacher:")
    assert "builtin:tiny-arith" in line and tiny_model in line  # names both tokenizers
    with pytest.raises(ValueError, match=r"distill.teacher: .* \(no config.json\)"):
        check_teacher_tokenizer(str(tmp_path / "missing"), tiny_model)
