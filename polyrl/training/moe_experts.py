"""polyrl's forward of transformers' fused expert collections (Qwen3-MoE, Qwen2-MoE; docs/moe.md).

transformers' `Qwen3MoeExperts` / `Qwen2MoeExperts` hold every expert of a layer as two fused
tensors, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], and dispatch their forward through
transformers' experts registry (`config._experts_implementation`). `use_grouped_experts(model)`
registers `grouped_experts_forward` there under `GROUPED_EXPERTS` and switches the model to it,
the same way training/varlen.py switches the attention: once for the model, so the recompute of
gradient checkpointing (inside backward) runs it too. transformers does not serialise the name
into a saved config (tested), so exported checkpoints load anywhere.

The forward, per layer:

1. the (token, slot) pairs are sorted by expert once (a stable sort: within an expert, tokens
   ascending), and each pair's hidden state is gathered with `index_select` (its backward is an
   `index_add`, cheaper on a CPU than the `index_put` of a tensor index);
2. every expert's rows are one contiguous segment, and each projection is one grouped matmul over
   the segments (`grouped_mm`; gate and up fused in one), or, where the grouped kernel cannot
   run, one matmul per expert on its segment (`expert_mlp`);
3. the outputs are weighted by the router and summed per token with `index_add` in the sorted
   order (on a CPU a serial, fixed order; for top-2 the sum of two equals transformers').

Under autocast (`actor.compute_dtype=bfloat16` with the ddp strategy) the expert products run in
the autocast dtype, as a `Linear` would; transformers' grouped path casts the input up to the
fp32 weights instead (grouped_mm is not autocast-aware), so there the experts ran in fp32.

What it keeps: the router is untouched (its gradient, routing replay and the load statistics
live there: training/moe_replay.py); the weights are read through the module, so peft's
parametrization of `gate_up_proj` / `down_proj` (LoRA on the experts, polyrl/training/lora.py)
applies; expert parallelism replaces this forward with its all-to-all dispatch
(training/expert_parallel.py), which runs its own experts through `expert_mlp`.

On devices other than the CPU, and inside torch.compile (`actor.compile`), the call goes to
transformers' own grouped forward unchanged: the grouped kernel's conditions on a GPU (dtype,
compute capability) and this forward's `.tolist()` under a compiler were not tested here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_EXPERTS = "polyrl_grouped"
"""The experts implementation name of a model switched by `use_grouped_experts`."""
_EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts")
_registered = False


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_kernel_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the grouped matmul runs these operands here: on the CPU, with every row stride a
    multiple of 16 bytes (the kernel's layout rule; its backward writes [*, out] rows too)."""
    if x.device.type != "cpu" or _grouped_mm() is None:
        return False
    size = x.element_size()
    return all(w.shape[-1] * size % 16 == 0 and w.shape[-2] * size % 16 == 0 for w in weights)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: the grouped kernel's backward refuses
    a broadcast one (stride 0, e.g. the gradient of a plain `.sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def expert_mlp(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
               act_fn) -> torch.Tensor:
    """`down_e(act(gate_e x) * up_e x)` of rows `x` sorted by expert, `counts[e]` rows of expert
    e (`gate_up` [E, 2I, H], `down` [E, H, I], all in one dtype)."""
    if not sum(counts):  # no rows: stay in the graph of the rows and the experts, so their (zero)
        # gradients still flow (expert parallelism's all-to-all backward must run on every rank);
        # the grouped kernel's backward refuses an empty input
        return x.new_zeros((0, down.shape[1])) + (x.sum() + gate_up.sum() + down.sum()) * 0
    if grouped_kernel_runs(x, gate_up, down):
        mm = _grouped_mm()
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gate, up = mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return _DenseGrad.apply(mm(act_fn(gate) * up, down.transpose(-2, -1), offs=offs))
    # one matmul per expert on its segment; unbind's backward stacks the experts' gradients once
    # (indexing the fused tensor per expert would add a whole-tensor gradient per expert)
    w_gate_up, w_down = gate_up.unbind(0), down.unbind(0)
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        if counts[e]:
            gate, up = F.linear(rows, w_gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(act_fn(gate) * up, w_down[e]))
    return torch.cat(outs)


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `*MoeExperts.forward` (tokens [N, H], top-k ids and weights [N, k]) with the
    pairs sorted by expert once (module doc)."""
    if hidden_states.device.type != "cpu" or torch.compiler.is_compiling():
        # (actor.compile traces transformers' forward, as before this module: not run compiled here)
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = self.gate_up_proj, self.down_proj  # through peft's parametrization, if any
    dtype = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else gate_up.dtype)
    with torch.autocast("cpu", enabled=False):  # explicit casts; the backward runs in the same dtype
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x = hidden_states.index_select(0, token).to(dtype)
        y = expert_mlp(x, counts, gate_up.to(dtype), down.to(dtype), self.act_fn)
        y = y * top_k_weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None]
        # in place into fresh zeros (index_add, not in place, would copy them first)
        return hidden_states.new_zeros(hidden_states.shape).index_add_(0, token, y.to(hidden_states.dtype))


def register() -> None:
    """Add `GROUPED_EXPERTS` to transformers' experts registry (idempotent)."""
    global _registered
    if not _registered:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register(GROUPED_EXPERTS, grouped_experts_forward)
        _registered = True


def has_experts(model: torch.nn.Module) -> bool:
    """Whether `model` has Qwen3-MoE / Qwen2-MoE fused expert collections (peft's parametrized
    subclasses included)."""
    return any(type(m).__name__.endswith(_EXPERTS) for m in model.modules())


def use_grouped_experts(model: torch.nn.Module) -> bool:
    """Switch `model`'s Qwen3-MoE / Qwen2-MoE experts to `grouped_experts_forward`, once; False
    (nothing changed) for a model without them."""
    if not has_experts(model) or not hasattr(model, "set_experts_implementation"):
        return False
    register()
    if model.config._experts_implementation != GROUPED_EXPERTS:
        model.set_experts_implementation(GROUPED_EXPERTS)
    return True
