"""The training-engine seam: how a model is trained across ranks, hidden from what is trained.

An engine owns one model on one rank of the policy's device mesh (polyrl/training/mesh.py: data
parallel, replicated or sharded, times sequence parallel) with its parameters, gradients,
optimizer and schedule, however they are sharded, and offers what an algorithm needs:

    forward(mb)                 log-probs (+ entropy) of a micro-batch's response tokens
    backward(loss)              accumulate gradients of one micro-batch's share of the loss
    optimizer_step(loss_value)  reduce gradients over the ranks, clip, step (or skip a NaN step)
    logprobs(batch)             no-grad log-probs of a whole batch, in the batch's layout
    named_weights()             full tensors, one at a time, for weight sync and export
    weight_stream()             the same with every name, shape and dtype up front (a
                                WeightStream, polyrl/weights/base.py): what a transport sends
                                without holding more than a bucket of it
    save(dir) / load(dir)       checkpoint state of this rank
    all_reduce(tensor, op)      a collective over the engine's data-parallel ranks (those with
                                different samples; a sequence-parallel group's ranks hold the
                                same, gathered, values and are not summed)

`DDPEngine` (ddp.py) replicates the model and all-reduces gradients; `FSDP2Engine` (fsdp2.py)
shards it; both split packed rows over a sequence-parallel group (ulysses.py). The PPO actor (workers/actor.py)
and, later, a critic are written against this interface only, so a sharded engine plugs in
without touching them or the loop (docs/architecture.md, "Training engines").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from polyrl.batch import MicroBatch, Ragged, RolloutBatch
from polyrl.weights.base import WeightStream


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    """True when the loss or gradient was NaN/inf and the update was dropped."""
    lr: float
    compile_s: float | None = None
    """Seconds spent compiling for this step (actor.compile), None when nothing was compiled."""


class NonFiniteUpdate(RuntimeError):
    """Too many updates in a row had a NaN/inf loss or gradient."""


class TrainingEngine(Protocol):
    world_size: int
    """Data-parallel ranks: what `all_reduce` sums over."""
    num_params: int

    def forward(self, mb: MicroBatch, with_entropy: bool = False,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self, loss_value: float) -> StepResult: ...

    def micro_batches(self, batch: RolloutBatch) -> Iterator[MicroBatch]: ...

    def logprobs(self, batch: RolloutBatch) -> Ragged: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def weight_stream(self) -> WeightStream: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...
