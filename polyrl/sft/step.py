"""One SFT optimizer step and one validation pass, written against the training-engine seam
(polyrl/training/base.py) exactly as the PPO actor is (polyrl/workers/actor.py).

The loss is the negative log-likelihood of assistant tokens *normalised by the global number of
loss tokens* (summed over every rank's shard of the batch before any forward): each micro-batch's
loss is then its share of the global mean, so accumulating gradients over micro-batches and
summing them over ranks (what `optimizer_step` does) gives exactly the gradient of one big batch,
however the batch was split.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from polyrl.batch import RolloutBatch, collate, plan_micro_batches
from polyrl.training.base import TrainingEngine


def _global(engine: TrainingEngine, *values: float) -> list[float]:
    return engine.all_reduce(torch.tensor(values, dtype=torch.float64)).tolist()


def train_step(engine: TrainingEngine, shard: RolloutBatch, device: torch.device,
               token_budget: int) -> dict[str, float]:
    """Forward/backward this rank's `shard` in token-budgeted micro-batches, then step."""
    start = time.perf_counter()
    tokens, seqs, fed = _global(engine, float(shard.loss_mask.values.sum()), float(len(shard)),
                                float(shard.lengths.sum()))
    denominator = max(tokens, 1.0)
    share = 0.0
    for idx in plan_micro_batches(shard.lengths, token_budget):
        mb = collate(shard, idx, device)
        logprob, _ = engine.forward(mb)
        loss = -(logprob * mb.response_mask).sum() / denominator
        engine.backward(loss)
        share += float(loss.detach())
    (loss_value,) = _global(engine, share)
    step = engine.optimizer_step(loss_value)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return {"train/loss": loss_value, "train/loss_tokens": tokens, "train/conversations": seqs,
            "actor/lr": step.lr, "actor/grad_norm": step.grad_norm,
            "actor/nonfinite_skipped": float(step.skipped), "timing/step": elapsed,
            "perf/tokens_per_s": fed / elapsed}


class ArgmaxTap:
    """Greedy predictions of the LM head, caught by a forward hook during `engine.forward`.

    The engine returns only the log-probs of the target tokens; token accuracy needs the argmax
    over the vocabulary, which the head computes anyway. Hooking the head reads it from the same
    forward instead of running a second one."""

    def __init__(self, engine: TrainingEngine):
        model = getattr(engine, "model", None)
        head = model.get_output_embeddings() if model is not None else None
        self.pred: torch.Tensor | None = None
        self.handle = head.register_forward_hook(self._hook) if head is not None else None

    def _hook(self, module: Any, args: Any, output: torch.Tensor) -> None:
        self.pred = output.argmax(-1)

    def take(self) -> torch.Tensor | None:
        pred, self.pred = self.pred, None
        return pred

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


@torch.no_grad()
def evaluate(engine: TrainingEngine, shard: RolloutBatch, device: torch.device,
             token_budget: int) -> dict[str, float]:
    """Validation loss (mean NLL per assistant token) and greedy token accuracy over all ranks."""
    model = getattr(engine, "model", None)
    was_training = bool(model is not None and model.training)
    if model is not None:
        model.eval()
    tap = ArgmaxTap(engine)
    nll = hits = 0.0
    have_acc = 1.0 if tap.handle is not None else 0.0
    try:
        for idx in plan_micro_batches(shard.lengths, token_budget):
            mb = collate(shard, idx, device)
            logprob, _ = engine.forward(mb)
            nll -= float((logprob.float() * mb.response_mask).sum())
            pred = tap.take()
            if pred is None or pred.shape != mb.target_ids.shape:
                have_acc = 0.0
            else:
                hits += float(((pred == mb.target_ids).float() * mb.response_mask).sum())
    finally:
        tap.close()
        if model is not None:
            model.train(was_training)
    nll, hits, tokens, with_acc = _global(engine, nll, hits, float(shard.loss_mask.values.sum()),
                                          have_acc)
    out = {"val/loss": nll / max(tokens, 1.0)}
    if with_acc == engine.world_size:  # every rank could read the head's predictions
        out["val/token_acc"] = hits / max(tokens, 1.0)
    return out
