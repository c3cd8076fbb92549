"""The critic's pure pieces: clipped value loss and explained variance.

Value loss as PPO implementations (OpenAI baselines, verl) compute it, per token, in the
response-aligned layout of polyrl/algorithms/advantages/gae.py:
    V_clip = V_old + clip(V - V_old, -c, c)
    L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)
c (algorithm.value_clip_range) keeps the critic within c of the values the advantages were
computed with, the critic's analogue of the policy's trust region; `None` is the plain squared
error. Explained variance 1 - Var[R - V] / Var[R] says how much of the return's variation the
critic predicts (1 perfect, 0 no better than a constant, < 0 worse).
"""

from __future__ import annotations

import torch

from polyrl.algorithms.losses.aggregation import AggMode, aggregate, masked_mean


def value_loss(
    values: torch.Tensor,  # [B, R] current critic, with grad
    old_values: torch.Tensor,  # [B, R] critic at rollout time (the values GAE used)
    returns: torch.Tensor,  # [B, R] GAE returns (targets)
    mask: torch.Tensor,  # [B, R] loss mask
    clip_range: float | None = 0.5,
    *,
    loss_agg_mode: AggMode = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    returns = returns.detach()
    error = (values - returns).square()
    if clip_range is None:
        loss_mat, clip_hit = error, torch.zeros_like(error, dtype=torch.bool)
    else:
        old = old_values.detach()
        clipped = old + (values - old).clamp(-clip_range, clip_range)
        error_clipped = (clipped - returns).square()
        loss_mat = torch.maximum(error, error_clipped)
        clip_hit = error_clipped > error  # the clipped (pessimistic) error was chosen
    loss = 0.5 * aggregate(loss_mat, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        stats = torch.stack([
            loss.detach().to(torch.float64),
            masked_mean(clip_hit.to(torch.float64), mask),
            masked_mean(values.detach().to(torch.float64), mask),
        ]).tolist()  # one device sync
    names = ("critic/value_loss", "critic/vf_clipfrac", "critic/vpred_mean")
    return loss, dict(zip(names, stats))


@torch.no_grad()
def explained_variance(
    values: torch.Tensor,  # [B, R]
    returns: torch.Tensor,  # [B, R]
    mask: torch.Tensor,  # [B, R]
) -> float:
    """1 - Var[returns - values] / Var[returns] over the mask; 0.0 where the returns have no
    variance (there is nothing to explain, and a NaN would poison the metric curves)."""
    m = mask.to(torch.float64)
    n = m.sum()
    if n < 1:
        return 0.0
    v, r = values.to(torch.float64), returns.to(torch.float64)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) ** 2) * m).sum() / n

    var_r = var(r)
    if var_r.item() <= 1e-12:
        return 0.0
    return float(1.0 - var(r - v) / var_r)
