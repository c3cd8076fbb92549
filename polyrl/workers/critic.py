"""The critic's update (PPO with a value model), written against the training-engine seam.

Same schedule as the policy's (`actor.ppo_epochs` passes, `num_mini_batches` optimizer steps,
token-budgeted micro-batches) and the same aggregation: each micro-batch's loss is its share of
the global mean over the loss tokens of all ranks, so the engine's gradient reduction is a sum.
"""

from __future__ import annotations

import torch

from polyrl.algorithms import AlgorithmConfig, value_loss
from polyrl.batch import RolloutBatch, split_evenly
from polyrl.training.base import TrainingEngine
from polyrl.training.config import ActorConfig

SHARE = ("critic/value_loss",)
LOCAL = ("critic/vf_clipfrac", "critic/vpred_mean")


class CriticUpdate:
    def __init__(self, engine: TrainingEngine, actor: ActorConfig, algo: AlgorithmConfig, device: torch.device):
        self.engine, self.actor, self.algo, self.device = engine, actor, algo, device

    def update(self, batch: RolloutBatch, num_mini_batches: int) -> dict[str, float]:
        metrics: dict[str, list[float]] = {}
        for _ in range(self.actor.ppo_epochs):
            for chunk in split_evenly(list(range(len(batch))), num_mini_batches):
                for k, v in self._optimizer_step(batch.select(chunk)).items():
                    metrics.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in metrics.items()}

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        engine = self.engine
        counts = engine.all_reduce(torch.tensor([float(mini.loss_mask.values.sum()), float(len(mini))],
                                                dtype=torch.float64))
        agg = {"num_tokens": max(float(counts[0]), 1.0), "num_seqs": max(float(counts[1]), 1.0)}
        sums = dict.fromkeys(SHARE + LOCAL, 0.0)
        # padded (packed, and cut to this rank's tokens, under sequence parallelism)
        for mb in engine.micro_batches(mini):
            values, _ = engine.forward(mb)
            loss, m = value_loss(values, mb.values, mb.returns, mb.response_mask, self.algo.value_clip_range,
                                 loss_agg_mode=self.algo.loss_agg_mode, **agg)
            engine.backward(loss)
            weight = mb.num_tokens / agg["num_tokens"]
            for k in SHARE:
                sums[k] += m[k]
            for k in LOCAL:
                sums[k] += m[k] * weight
        keys = sorted(sums)
        totals = engine.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        # shares of the global mean (losses by aggregation, local means by their token weight)
        out = {k: float(t) for k, t in zip(keys, totals)}
        step = engine.optimizer_step(out["critic/value_loss"])
        out.update({"critic/grad_norm": step.grad_norm, "critic/lr": step.lr})
        return out
