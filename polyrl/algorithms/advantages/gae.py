"""GAE: per-token advantages from a critic's values (PPO with a critic).

Generalized Advantage Estimation, Schulman et al. 2015 (arXiv:1506.02438), eqs. 11-16:
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}           returns_t = A_t + V_t (the critic's target)
with V and A of the step after the last action taken as 0 (the episode ends with the response).

Layout: response-aligned [B, R] tensors. values[:, t] is V of the state in which response token
t is chosen, i.e. read from the same hidden state whose logits give logprob[:, t].

Multi-turn convention: the recursion runs over the loss-mask tokens only. A masked token in the
middle of a response (tool or user output spliced into the turn) is not an action of the policy,
so it is not a time step: the "next" state of the last action before a hole is the first action
after it, with a single factor of gamma, and the values and rewards sitting on masked positions
are never read. verl's GAE treats multi-turn observation tokens the same way, so numbers match
runs made there; counting the hole's tokens as steps would instead discount an action's credit
by the length of a tool's output, which says nothing about the policy. Put any reward on a loss token (`outcome_token_rewards` puts a sequence's reward on its
last loss token). Advantages and returns are 0 on masked positions.
"""

from __future__ import annotations

import torch


def outcome_token_rewards(
    rewards: torch.Tensor,  # [B] one scalar reward per response
    loss_mask: torch.Tensor,  # [B, R]
) -> torch.Tensor:  # [B, R] float32: the reward on each row's last loss token, 0 elsewhere
    """A verifiable (outcome) reward as a token-level reward for GAE.

    The reward arrives after the last action; a row without loss tokens has no action to credit
    and gets nothing.
    """
    mask = loss_mask.bool()
    R = mask.shape[-1]
    positions = torch.arange(R, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(-1)  # [B]; -1 where the row is empty
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.to(torch.float32)[rows]
    return out


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,  # [B, R]
    values: torch.Tensor,  # [B, R] critic's V at rollout time
    loss_mask: torch.Tensor,  # [B, R] 1 on the policy's tokens; holes for tool output allowed
    gamma: float,
    lam: float,
    *,
    whiten: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # advantages [B, R], returns [B, R], both float32
    """GAE over the loss-mask tokens of each row (see the module docstring for the convention).

    `whiten` standardises the advantages over all valid tokens of the batch (mean 0, std 1),
    as PPO implementations do; the returns are computed from the raw advantages.
    """
    # float64: the recursion sums up to R terms; the batch is small and lives on the driver
    r = token_rewards.to(torch.float64)
    v = values.to(torch.float64)
    valid = loss_mask.bool()
    B, R = valid.shape
    next_value = torch.zeros(B, dtype=torch.float64, device=v.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros(B, R, dtype=torch.float64, device=v.device)
    for t in reversed(range(R)):  # R vector steps over the batch
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        m = valid[:, t]
        adv[:, t] = torch.where(m, a_t, 0.0)
        # a masked position passes the next action's value and advantage through unchanged
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
    returns = torch.where(valid, adv + v, 0.0)
    if whiten:
        adv = masked_whiten(adv, valid, eps)
    return adv.to(torch.float32), returns.to(torch.float32)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the positions of `mask` (unbiased std, as in
    polyrl/algorithms/advantages/reinforce_pp.py); 0 off the mask, and all 0 under two tokens."""
    m = mask.to(x.dtype)
    n = m.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps) * m
