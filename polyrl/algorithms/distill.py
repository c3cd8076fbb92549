"""On-policy distillation: a frozen teacher scores every token the student sampled.

The per-token reward is the negative reverse KL sample on the student's own tokens,
    r_t = -coef * (log pi_student(y_t) - log pi_teacher(y_t)),
and it enters as a token-level advantage (no critic, no discounting: each token's signal is its
own), added to the estimator's outcome advantages scaled by `reward_weight`. Its policy gradient
minimises KL(student || teacher) on the student's own samples, the reverse KL of GKD
(arXiv:2306.13649). Only loss-mask tokens (the ones the student sampled; tool
or environment output in multi-turn samples is masked out) carry it. All inputs are [B, T]
response-aligned; no gradient flows through any of it. The config is distill_config.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polyrl.algorithms.losses.aggregation import masked_mean


def distill_token_rewards(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor, coef: float) -> torch.Tensor:
    """-coef * (log pi_student - log pi_teacher) on loss tokens, 0 elsewhere. [B, T] float32."""
    m = mask.to(torch.float32)
    gap = (student_logprobs.float() - teacher_logprobs.float()) * m
    return -coef * gap


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over loss tokens of log pi_student - log pi_teacher: the single-sample estimate of
    KL(student || teacher) per token (the `distill/reverse_kl` metric)."""
    gap = (student_logprobs.float() - teacher_logprobs.float()) * mask.to(torch.float32)
    return float(masked_mean(gap, mask.to(torch.float32)))


def distill_advantages(outcome: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       mask: torch.Tensor, *, coef: float, reward_weight: float
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """reward_weight * outcome + the distillation rewards, zero off the loss mask; and metrics.

    `outcome`: the estimator's advantages [B, T] (per-sequence ones broadcast over the tokens)."""
    with torch.no_grad():
        m = mask.to(torch.float32)
        token = distill_token_rewards(student_logprobs, teacher_logprobs, mask, coef)
        adv = (reward_weight * outcome.float() + token) * m
        metrics = {
            "distill/reverse_kl": reverse_kl(student_logprobs, teacher_logprobs, mask),
            "distill/token_reward_mean": float(masked_mean(token, m)),
            "distill/coef": float(coef),
            "distill/reward_weight": float(reward_weight),
        }
    return adv, metrics


def _describe(tokenizer, path: str) -> str:
    return f"{type(tokenizer).__name__} of {path}, {len(tokenizer)} tokens"


def check_teacher_tokenizer(teacher: str, student_tokenizer: str, trust_remote_code: bool = False) -> None:
    """The teacher scores the student's token ids, so both must map ids to the same strings.
    Raises ValueError with one line naming both tokenizers (checked before any actor starts)."""
    from polyrl.builtin import resolve
    from polyrl.modeling import load_tokenizer

    try:
        directory = Path(resolve(teacher)).expanduser()
    except FileNotFoundError as exc:
        raise ValueError(f"distill.teacher: {exc}") from None
    if not (directory / "config.json").is_file():
        raise ValueError(f"distill.teacher: {teacher} is not a Hugging Face model directory (no config.json); "
                         "give a local directory, e.g. the output of `polyrl export`")
    try:
        theirs = load_tokenizer(directory, trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"distill.teacher: cannot load the tokenizer of {teacher}: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    ours = load_tokenizer(student_tokenizer, trust_remote_code)
    if theirs.get_vocab() != ours.get_vocab():
        raise ValueError(f"distill.teacher: the teacher's tokenizer ({_describe(theirs, teacher)}) differs from "
                         f"the student's ({_describe(ours, student_tokenizer)}); distillation scores the "
                         "student's token ids, so give a teacher with the same vocabulary")
