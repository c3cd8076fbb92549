"""The compiled training step (`actor.compile`): whether to compile, and how long compiling took.

`torch.compile` (inductor) traces the engine's forward — the model body and the log-prob head —
and AOTAutograd compiles the matching backward; on a CPU, inductor generates C++ that fuses the
element-wise work (norms, rotary embeddings, activations, autocast's casts, the log-softmax) around
the bf16 matmuls. Shapes are compiled dynamic from the start: every micro-batch has its own
(rows, length), and a static graph would recompile for each.

Compiling costs minutes on a CPU, so `auto` turns it on only where it was measured to pay
(`benchmarks/compile_step.py`, docs/benchmarks.md "Compiled step and weight casts").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AUTO_MIN_STEPS = 500
"""Optimizer steps from which `auto` compiles a CPU bf16 run. Measured on the 30M benchmark model
(2 shared cores): a cold compile took ~4 min (1 min with inductor's on-disk cache warm) and saved
0.56-0.68 s of a 4.2-6.1 s step (1.10-1.19x), so it repays itself after ~350-420 steps; 500
leaves room for recompiles (a no-grad graph for recomputed log-probs, a one-row micro-batch)."""


def should_compile(setting: str, *, device: torch.device, compute_dtype: torch.dtype, horizon: int | None,
                   lora: bool, gradient_checkpointing: bool) -> bool:
    """`actor.compile` resolved for one engine; `horizon` None is a frozen (reference) engine."""
    if setting != "auto":
        return setting == "on"
    return (device.type == "cpu" and compute_dtype == torch.bfloat16 and horizon is not None
            and horizon >= AUTO_MIN_STEPS and not lora and not gradient_checkpointing)


def compile_head(head: Callable) -> Callable:
    return torch.compile(head, dynamic=True)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + AOTAutograd + inductor, backward
    included: AOTAutograd compiles it with the forward)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
