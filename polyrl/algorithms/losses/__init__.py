"""Policy losses. Each registered entry has the signature
    fn(cfg: AlgorithmConfig, logprob, old_logprob, advantages, response_mask,
       *, num_tokens=None, num_seqs=None) -> (loss scalar, metrics)
with [B, T] tensors; `num_tokens` / `num_seqs` are the global counts for gradient accumulation.
A package adds one through the `polyrl.policy_losses` entry-point group; a config may also name
one by import path (docs/plugins.md). The loss runs in the policy workers (Ray actors).
"""

from __future__ import annotations

from typing import Callable

import torch

from polyrl.algorithms.losses.aggregation import AGG_MODES, aggregate, masked_mean
from polyrl.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

ENTRY_POINT_GROUP = "polyrl.policy_losses"
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", entry_point_group=ENTRY_POINT_GROUP,
                                                 import_paths=True)
POLICY_LOSSES.register("ppo_clip", "polyrl.algorithms.losses.ppo:ppo_clip_policy_loss")
POLICY_LOSSES.register("gspo", "polyrl.algorithms.losses.gspo:gspo_policy_loss")
POLICY_LOSSES.register("gspo_token", "polyrl.algorithms.losses.gspo:gspo_token_policy_loss")

__all__ = ["AGG_MODES", "POLICY_LOSSES", "aggregate", "masked_mean"]
