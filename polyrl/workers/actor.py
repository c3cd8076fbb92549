"""The PPO-family policy update, written against the training-engine seam (training/base.py).

One trainer step = `actor.ppo_epochs` passes over the batch, each split into `num_mini_batches`
optimizer steps, each accumulated over token-budgeted micro-batches. Losses are aggregated over
the *global* token / sequence counts of the mini-batch (all ranks), so each micro-batch's loss is
its share of the global mean and the engine's gradient reduction is a plain sum.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from polyrl.algorithms import AlgorithmConfig, actor_loss
from polyrl.algorithms.off_policy import OffPolicyConfig
from polyrl.batch import RolloutBatch, split_evenly
from polyrl.training.base import TrainingEngine
from polyrl.training.config import ActorConfig
from polyrl.training.moe_replay import RouterReplay

SHARE_METRICS = frozenset({"actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy"})
"""Metrics that are a micro-batch's share of a global mean: summed over micro-batches and ranks."""
LOCAL_METRICS = frozenset({"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                           "actor/ratio_mean"})
"""Per-token means of one micro-batch: weighted by tokens, averaged over ranks."""
OFF_POLICY_METRICS = frozenset({"off_policy/is_weight_mean", "off_policy/is_clipped_frac",
                                "off_policy/masked_frac", "off_policy/kl_rollout_proximal"})
"""Per-token means like LOCAL_METRICS, present when the off-policy correction is on."""
MAX_METRICS = frozenset({"off_policy/is_weight_max"})
"""Maxima: the largest over micro-batches and ranks."""


class PPOActor:
    def __init__(self, engine: TrainingEngine, actor: ActorConfig, algo: AlgorithmConfig,
                 off_policy: OffPolicyConfig, device: torch.device):
        self.engine, self.actor, self.algo, self.off_policy = engine, actor, algo, off_policy
        self.device = device
        module = getattr(engine, "module", None)
        # a mixture-of-experts policy: routing replay and the moe/ metrics (training/moe_replay.py)
        self.replay = RouterReplay.install(module, actor.router_replay) if module is not None else None

    def update(self, batch: RolloutBatch, num_mini_batches: int, use_rollout_logprobs: bool,
               version: int | None = None) -> dict:
        """PPO epochs over `batch` (this rank's shard) split into `num_mini_batches` steps.

        `version`: the policy's weights version now (before this update). Samples generated
        entirely with it are where the engine's log-probs and the trainer's are of the same
        weights: their gap is `rollout/logprob_diff_{mean,max}` (None: every sample counts).
        """
        single_step = num_mini_batches == 1 and self.actor.ppo_epochs == 1
        same = self._same_weights(batch, version)
        mismatch = LogprobMismatch(self.engine) if same is not None else None
        r2 = self.replay is not None and self.actor.router_replay == "R2"
        if r2:  # R2 replays the trainer's own old-policy routes, recorded below, not the engine's
            batch = batch.replace(routes=None)
        if not single_step and not use_rollout_logprobs:
            if r2:
                self.replay.record_into = self.replay.empty_routes(batch.response_ids)
            # proximal; the rollout's stay for the off-policy correction
            batch = batch.replace(old_logprobs=self.engine.logprobs(batch))
            if r2:
                batch, self.replay.record_into = batch.replace(routes=self.replay.record_into), None
            if mismatch is not None:
                mismatch.add_ragged(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, same)
                same = None  # measured over the whole batch already
        metrics: dict[str, list[float]] = {}
        start, tokens = time.perf_counter(), 0
        for epoch in range(self.actor.ppo_epochs):
            for i, chunk in enumerate(split_evenly(list(range(len(batch))), num_mini_batches)):
                mini = batch.select(chunk)
                tokens += int(mini.lengths.sum())
                # only the first optimizer step's forwards run on the rollout's weights
                measure = (mismatch, same[chunk]) if same is not None and epoch == i == 0 else None
                for k, v in self._optimizer_step(mini, single_step and not use_rollout_logprobs,
                                                 measure).items():
                    metrics.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["perf/update_tokens_per_s"] = tokens / max(time.perf_counter() - start, 1e-9)
        if mismatch is not None:
            out.update(mismatch.metrics())
        if self.replay is not None:
            out.update(self.replay.metrics(self.engine))
        return out

    @staticmethod
    def _same_weights(batch: RolloutBatch, version: int | None) -> torch.Tensor | None:
        """[n] bool: samples whose every token the engine generated with the weights the trainer
        holds now; None when the batch has no rollout log-probs to compare."""
        if batch.rollout_logprobs is None:
            return None
        if version is None:
            return torch.ones(len(batch), dtype=torch.bool)
        return (batch.min_version == version) & (batch.max_version == version)

    def _optimizer_step(self, mini: RolloutBatch, detach_as_old: bool,
                        measure: tuple["LogprobMismatch", torch.Tensor] | None = None) -> dict[str, float]:
        engine, algo = self.engine, self.algo
        counts = engine.all_reduce(torch.tensor([float(mini.loss_mask.values.sum()), float(len(mini))],
                                                dtype=torch.float64))
        agg = {"num_tokens": max(float(counts[0]), 1.0), "num_seqs": max(float(counts[1]), 1.0)}
        # the same keys on every rank, even one without samples, so the all-reduce lines up
        local = LOCAL_METRICS | (OFF_POLICY_METRICS if self.off_policy.active else frozenset())
        sums: dict[str, float] = dict.fromkeys(SHARE_METRICS | local, 0.0)
        maxima: dict[str, float] = dict.fromkeys(MAX_METRICS, 0.0) if self.off_policy.active else {}
        for mb in engine.micro_batches(mini):  # padded or packed: actor.packing
            logprob, entropy = engine.forward(mb, with_entropy=True, entropy_grad=algo.entropy_coeff > 0)
            old = logprob.detach() if detach_as_old else mb.old_logprobs
            if measure is not None:
                measure[0].add_padded(logprob.detach(), mb.rollout_logprobs, mb.response_mask,
                                      measure[1][mb.indices])
            loss, m = actor_loss(algo, logprob, old, mb.advantages, mb.response_mask,
                                 ref_logprob=mb.ref_logprobs, entropy=entropy,
                                 rollout_logprob=mb.rollout_logprobs, off_policy=self.off_policy, **agg)
            aux = self.replay.aux_loss() if self.replay is not None and self.actor.router_aux_loss_coef else None
            if aux is not None:  # the load-balancing loss, this micro-batch's share of it
                loss = loss + self.actor.router_aux_loss_coef * aux * (mb.num_tokens / agg["num_tokens"])
            engine.backward(loss)
            weight = mb.num_tokens / agg["num_tokens"]
            for k in MAX_METRICS & m.keys():
                maxima[k] = max(maxima.get(k, 0.0), m.pop(k))
            for k, v in m.items():
                if k not in sums and engine.world_size > 1:
                    continue  # a key only some ranks may have cannot be all-reduced
                # losses are already this micro-batch's share of the global mean; per-token
                # statistics (clip fraction, ratio) are local means: weight them by tokens
                sums[k] = sums.get(k, 0.0) + (v if k in SHARE_METRICS else v * weight)
        sums = self._reduce(sums, maxima)
        step = engine.optimizer_step(sums["actor/loss"])
        sums.update({"actor/grad_norm": step.grad_norm, "actor/lr": step.lr,
                     "actor/nonfinite_skipped": float(step.skipped)})
        if step.compile_s is not None:  # actor.compile: the steps that compiled
            sums["perf/compile_s"] = step.compile_s
        return sums

    def _reduce(self, sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
        """Sums over ranks: every micro-batch's value is already weighted by its share of the
        *global* tokens (losses by aggregation, local means by `weight`); maxima take the max."""
        if self.engine.world_size > 1:
            keys = sorted(sums)
            totals = self.engine.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
            sums = {k: float(t) for k, t in zip(keys, totals)}
            if maxima:
                names = sorted(maxima)
                peaks = self.engine.all_reduce(torch.tensor([maxima[k] for k in names], dtype=torch.float64), "max")
                maxima = dict(zip(names, peaks.tolist()))
        return {**sums, **maxima}


class LogprobMismatch:
    """|trainer - engine| log-prob over loss tokens the engine sampled with the trainer's current
    weights: the rollout / trainer numerical gap every framework's users ask about (different
    kernels, batch shapes and dtypes on the two sides). Mean and max over all ranks' tokens."""

    def __init__(self, engine: TrainingEngine):
        self.engine = engine
        self.total = self.count = self.peak = 0.0

    def add_padded(self, trainer: torch.Tensor, rollout: torch.Tensor | None, mask: torch.Tensor,
                   same: torch.Tensor) -> None:
        """[b, R] log-probs and loss mask of one micro-batch; `same`: [b] bool."""
        if rollout is None:
            return
        weight = mask.float() * same.to(mask.device, torch.float32).unsqueeze(1)
        weight = weight * ~torch.isnan(rollout)  # NaN: a log-prob the engine could not report
        gap = (trainer.float() - rollout.float()).abs().nan_to_num(0.0) * weight
        self.total += float(gap.sum())
        self.count += float(weight.sum())
        self.peak = max(self.peak, float(gap.max()) if gap.numel() else 0.0)

    def add_ragged(self, trainer: Any, rollout: Any, mask: Any, same: torch.Tensor) -> None:
        """Whole-batch Ragged log-probs (one value per response token)."""
        per_token = torch.repeat_interleave(same, rollout.lengths).float()
        weight = mask.values.float() * per_token * ~torch.isnan(rollout.values)  # NaN: not reported
        gap = (trainer.values.float().cpu() - rollout.values.float()).abs().nan_to_num(0.0) * weight
        self.total += float(gap.sum())
        self.count += float(weight.sum())
        self.peak = max(self.peak, float(gap.max()) if gap.numel() else 0.0)

    def metrics(self) -> dict[str, float]:
        total, count, peak = self.total, self.count, self.peak
        if self.engine.world_size > 1:  # every rank calls this once per update: the keys line up
            total, count = self.engine.all_reduce(torch.tensor([total, count], dtype=torch.float64)).tolist()
            peak = float(self.engine.all_reduce(torch.tensor([peak], dtype=torch.float64), "max")[0])
        if count == 0:
            return {}
        return {"rollout/logprob_diff_mean": total / count, "rollout/logprob_diff_max": peak}
