"""The learning-rate schedule over a run: warm-up, then decay counted in optimizer steps.

One trainer step takes `ppo_epochs x num_mini_batches` optimizer steps (`PolicyWorker.update`);
`drive_run` steps a real AdamW + LambdaLR the way that loop does, so a horizon counted in trainer
steps (the old bug) would reach `min_lr_ratio` a quarter of the way through these runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.batch import split_evenly
from polyrl.training.config import ActorConfig
from polyrl.training.optim import build_optimizer, optimizer_steps_per_train_step, total_optimizer_steps

LR = 1e-3


def drive_run(cfg: ActorConfig, train_steps: int, num_mini_batches: int, batch: int = 8) -> list[float]:
    """The learning rate each optimizer step of the run used, stepping as `PolicyWorker.update`."""
    model = torch.nn.Linear(2, 1)
    horizon = total_optimizer_steps(cfg, train_steps, num_mini_batches)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg, horizon)
    used = []
    for _ in range(train_steps):
        for _ in range(cfg.ppo_epochs):
            for _chunk in split_evenly(list(range(batch)), num_mini_batches):
                used.append(scheduler.get_last_lr()[0])
                model(torch.ones(1, 2)).sum().backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    used.append(scheduler.get_last_lr()[0])  # where the schedule ends
    return used


def test_optimizer_steps_per_train_step_counts_epochs_and_mini_batches():
    assert optimizer_steps_per_train_step(ActorConfig(ppo_epochs=1), 1) == 1
    assert optimizer_steps_per_train_step(ActorConfig(ppo_epochs=2), 4) == 8
    assert total_optimizer_steps(ActorConfig(ppo_epochs=3), 10, 2) == 60
    with pytest.raises(ValueError, match="num_mini_batches"):
        optimizer_steps_per_train_step(ActorConfig(), 0)


def test_warmup_is_linear_in_optimizer_steps():
    cfg = ActorConfig(lr=LR, warmup_steps=4, lr_schedule="constant", ppo_epochs=2)
    used = drive_run(cfg, train_steps=3, num_mini_batches=2)
    assert used[:4] == pytest.approx([LR * k / 4 for k in (1, 2, 3, 4)])
    assert used[4:] == pytest.approx([LR] * (len(used) - 4))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("epochs,mini_batches", [(1, 1), (2, 1), (1, 4), (2, 2)])
def test_decay_spans_every_optimizer_step_of_the_run(schedule, epochs, mini_batches):
    cfg = ActorConfig(lr=LR, warmup_steps=2, lr_schedule=schedule, min_lr_ratio=0.1, ppo_epochs=epochs)
    train_steps = 5
    used = drive_run(cfg, train_steps, mini_batches)
    steps = train_steps * epochs * mini_batches
    assert len(used) == steps + 1
    floor = LR * cfg.min_lr_ratio
    # still decaying at the run's last optimizer step, at the floor exactly once all are taken
    assert all(lr > floor for lr in used[:steps]), used
    assert used[steps] == pytest.approx(floor, rel=1e-12)
    assert all(a >= b for a, b in zip(used[2:], used[3:])), "decay is monotone after warm-up"
    # halfway through the decay the schedule is at its own midpoint, not at the floor
    span = steps - cfg.warmup_steps
    if span % 2 == 0:
        mid = used[cfg.warmup_steps + span // 2]
        decay = 0.5 * (1 + math.cos(math.pi / 2)) if schedule == "cosine" else 0.5
        assert mid == pytest.approx(LR * (0.1 + 0.9 * decay), rel=1e-9)


def test_a_horizon_in_trainer_steps_would_floor_early():
    """The bug this module's horizon fixes, stated directly: 5 trainer steps of 2 epochs x 2
    mini-batches are 20 optimizer steps; a 5-step horizon hits the floor after step 5."""
    cfg = ActorConfig(lr=LR, lr_schedule="linear", min_lr_ratio=0.0, ppo_epochs=2)
    model = torch.nn.Linear(2, 1)
    _, wrong = build_optimizer(model.parameters(), cfg, 5)
    _, right = build_optimizer(model.parameters(), cfg, total_optimizer_steps(cfg, 5, 2))
    for _ in range(10):
        wrong.optimizer.step()
        wrong.step()
        right.optimizer.step()
        right.step()
    assert wrong.get_last_lr()[0] == 0.0
    assert right.get_last_lr()[0] == pytest.approx(LR / 2)


def test_fused_adamw_where_every_parameter_has_the_kernel():
    """The kernel is a rule of the parameters' devices, never of timing: fused on CPU (torch's
    fused AdamW), foreach on a device without the fused kernel; one step of each agrees."""
    from polyrl.training.optim import kernel

    cpu = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    assert kernel(cpu) == {"fused": True}
    assert kernel([torch.nn.Parameter(torch.empty(3, device="meta"))]) == {"foreach": True}
    assert kernel([]) == {"foreach": True}
    twin = [torch.nn.Parameter(p.detach().clone()) for p in cpu]
    start = [p.detach().clone() for p in cpu]
    fused, _ = build_optimizer(cpu, ActorConfig(lr=1e-2), horizon=10)
    plain = torch.optim.AdamW(twin, lr=1e-2, betas=ActorConfig().betas, eps=ActorConfig().eps,
                              weight_decay=ActorConfig().weight_decay, foreach=True)
    assert fused.defaults["fused"] and not plain.defaults.get("fused")
    for _ in range(3):
        for p, q in zip(cpu, twin):
            p.grad = torch.full_like(p, 0.5)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q, p0 in zip(cpu, twin, start):
        assert (p - p0).abs().min() > 1e-3  # three steps of lr 1e-2 moved every element
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
