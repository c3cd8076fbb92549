"""The SFT loss on the real training engine: masked NLL over the global count of assistant tokens,
so any split into micro-batches - or over ranks (real gloo processes) - gives the gradient of
the whole batch computed directly from the model's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.platform import get_platform
from polyrl.sft.data import as_batch
from polyrl.sft.step import evaluate, train_step
from polyrl.sft.template import Encoded
from polyrl.training import build_engine
from polyrl.training.config import ActorConfig
from polyrl.training.model_loading import load_causal_lm

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))


def conversations(n: int = 6, seed: int = 0) -> list[Encoded]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(2, 100, (length,), generator=g).tolist()
        mask = [0] * length
        for start in range(2, length, 4):  # holes: two assistant tokens, two others, ...
            mask[start:start + 2] = [1, 1][: length - start]
        out.append(Encoded(ids, mask))
    return out


def reference_grads(model_path: str, encoded: list[Encoded]) -> dict[str, torch.Tensor]:
    """d/dθ of the mean NLL over every assistant token of the batch, from full-sequence logits."""
    model = load_causal_lm(model_path)
    total = sum(sum(e.loss_mask[1:]) for e in encoded)
    loss = 0.0
    for e in encoded:
        ids = torch.tensor([e.input_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
        loss = loss - (picked * torch.tensor(e.loss_mask[1:], dtype=torch.float32)).sum() / total
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def engine_for(model_path: str, budget: int, rank: int = 0, world: int = 1):
    cfg = ActorConfig(lr=1e-3, micro_batch_tokens=max(budget, 64), grad_clip=None)
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    return build_engine(load_causal_lm(model_path).to(device), cfg, platform, device,
                        rank=rank, world_size=world, horizon=10), device


def captured_step(engine, batch, device, budget) -> tuple[dict, dict[str, torch.Tensor]]:
    """train_step on the real engine, reading this rank's accumulated gradients as the step
    begins (before the engine sums them over ranks and updates)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer_step

    def capture(loss_value):
        grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None})
        return step(loss_value)

    engine.optimizer_step = capture
    metrics = train_step(engine, batch, device, budget)
    return metrics, grads


@pytest.mark.parametrize("budget", [64, 100_000])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(tiny_model, budget):
    encoded = conversations()
    want = reference_grads(tiny_model, encoded)
    engine, device = engine_for(tiny_model, budget)
    batch = as_batch(encoded)
    metrics, got = captured_step(engine, batch, device, budget)
    assert metrics["train/loss_tokens"] == sum(sum(e.loss_mask[1:]) for e in encoded)
    assert any(g.abs().sum() > 0 for g in got.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_validation_loss_and_accuracy_match_the_logits(tiny_model):
    encoded = conversations(4, seed=1)
    engine, device = engine_for(tiny_model, 64)
    got = evaluate(engine, as_batch(encoded), device, 64)
    model = load_causal_lm(tiny_model)
    nll = hits = tokens = 0.0
    with torch.no_grad():
        for e in encoded:
            ids = torch.tensor([e.input_ids])
            logits = model(input_ids=ids).logits[0, :-1].float()
            mask = torch.tensor(e.loss_mask[1:], dtype=torch.float32)
            target = ids[0, 1:]
            nll -= float((torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0] * mask).sum())
            hits += float(((logits.argmax(-1) == target).float() * mask).sum())
            tokens += float(mask.sum())
    assert got["val/loss"] == pytest.approx(nll / tokens, rel=1e-5)
    assert got["val/token_acc"] == pytest.approx(hits / tokens)


def _rank_grads(rank, world, model_path, budget):
    """One rank of a real gloo world: its shard of the batch, its share of the gradient."""
    from polyrl.batch import split_evenly

    engine, device = engine_for(model_path, budget, rank, world)
    batch = as_batch(conversations())
    shard = batch.select(split_evenly(list(range(len(batch))), world)[rank])
    metrics, grads = captured_step(engine, shard, device, budget)
    return metrics["train/loss"], {n: g.numpy() for n, g in grads.items()}


def test_two_gloo_ranks_reduce_to_the_whole_batch_gradient(tiny_model, tmp_path):
    from gloo_world import run_world_ok

    want = reference_grads(tiny_model, conversations())
    results = run_world_ok(_rank_grads, 2, tmp_path, args=(tiny_model, 64), timeout_s=120)
    (loss0, g0), (loss1, g1) = results[0], results[1]
    assert loss0 == pytest.approx(loss1)  # the global loss, reported alike on both ranks
    for name, g in want.items():  # each rank's share; the engine's all-reduce sums them
        assert not torch.equal(torch.from_numpy(g0[name]), g) or not g.any()
        torch.testing.assert_close(torch.from_numpy(g0[name] + g1[name]), g, rtol=1e-4, atol=1e-6, msg=name)
