"""Tensor parallelism in training (actor.tensor_parallel_size), with `torch.distributed.tensor.parallel`
on the Hugging Face modules themselves.

Which module is sliced how comes from the model's own plan, `config.base_model_tp_plan`
(transformers ships one for Qwen2, Qwen3, Qwen3-MoE, Llama: `{"layers.*.self_attn.q_proj":
"colwise", ...}`), else from `DEFAULT_PLAN` (the same names, the layout of most decoder models).
Its styles become torch's:

    colwise                         ColwiseParallel: output features (heads, MLP width) sliced
    rowwise                         RowwiseParallel: input features sliced, output all-reduced
    replicated_with_grad_allreduce  a per-head norm (Qwen3's q_norm / k_norm): its weight a
                                    replicated DTensor over inputs sliced by head, so its
                                    gradient is summed over the slices (torch's SequenceParallel
                                    on the heads dim)

A style the model names and this module does not know stops the run (its name in the message).
A MoE layer's experts are in no plan (only its attention, and dense MLP layers, are sliced):
they stay whole on every tp rank, their inputs and gradients identical there.

The vocabulary is sliced too, so no rank builds the full logits: the input embedding row-wise
(each rank looks up the token ids of its vocabulary rows, the outputs are all-reduced) and the
LM head's weight by rows, the same rows, so a tied head stays one parameter. The head is never
called as a module: training/vocab_parallel.py takes the log-softmax over the slices.

LoRA (model.lora_rank > 0): peft wraps each adapted projection in a LoRA layer (`base_layer`,
`lora_A.<adapter>`, `lora_B.<adapter>`) under the projection's own name, so the plan's names find
the wrapper, and the wrapper is the unit sliced (`_parallelize_lora`): its input and output
hooks are the projection's, and inside it everything is DTensor arithmetic.

    colwise   W and B sliced by output rows, A whole: x A^T is the same on every rank, B's slice
              gives this rank's output features, added to W's; A's gradient (a partial sum per
              rank) is summed over tp by FSDP2 (it brings every gradient to its parameter's
              placement), and so is the gradient of x through both branches
    rowwise   W and A sliced by input columns, B whole: x's slice times A's slice is a partial
              sum of x A^T, B keeps it partial, and the one all-reduce of the output sums the
              base and the LoRA branch together

A LoRA layer in no plan (a MoE layer's router or experts) stays whole on every tp rank, as its
base does. LoRA on the LM head is refused under tp: the head is sliced by vocabulary rows and
never called as a module, so its adapter would never run.

Attention works unchanged on a rank's heads: Qwen2 / Qwen3 / Llama reshape q, k, v with `-1`
heads, and the grouped-query ratio heads / kv_heads is the same per slice. Hence the one check
that the model divides (`check_divisible`): attention heads, key-value heads and the MLP width by
tp. The vocabulary need not divide (the bundled tiny models have 259 / 265 tokens): DTensor
slices it as torch.chunk does, the last rank a row or so short.
"""

from __future__ import annotations

import fnmatch
from functools import partial

import torch

from polyrl.training import lora

DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
"""polyrl's plan for a model whose config ships none (names under the base model)."""


class TensorParallelError(ValueError):
    """A model or setting tensor parallelism cannot slice; the message names the key."""


def check_divisible(config, tp: int) -> None:
    """The one divisibility check of tensor parallelism: heads, key-value heads and MLP width."""
    text = getattr(config, "text_config", None) or config
    sizes = {"num_attention_heads": getattr(text, "num_attention_heads", None),
             "num_key_value_heads": getattr(text, "num_key_value_heads", None)
             or getattr(text, "num_attention_heads", None),
             "intermediate_size": getattr(text, "intermediate_size", None)}
    for name, size in sizes.items():
        if size is not None and size % tp:
            raise TensorParallelError(f"actor.tensor_parallel_size={tp} does not divide the model's {name}={size}; "
                                      f"set actor.tensor_parallel_size to a divisor of {size}")


def model_plan(model: torch.nn.Module) -> dict[str, str]:
    """{module-name pattern under the base model: style}: the config's plan, else polyrl's."""
    return dict(getattr(model.config, "base_model_tp_plan", None) or DEFAULT_PLAN)


def parallelize(model: torch.nn.Module, tp_mesh, *, tp: int) -> None:
    """Slice `model` (a causal LM, before fsdp2 shards it) over `tp_mesh` (1-D, the tp ranks), in
    place. Every rank must hold the same full weights."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    check_divisible(model.config, tp)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              # [batch, tokens, heads, head_dim]: the heads dim is the one tp slices
              "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True)}
    base = model.base_model
    plan = model_plan(model)
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise TensorParallelError(f"actor.tensor_parallel_size={tp}: {type(model).__name__}'s tensor-parallel plan "
                                  f"uses {unknown}, which polyrl does not map; set actor.tensor_parallel_size=1")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if lora.is_lora_layer(head):
        raise TensorParallelError(f"actor.tensor_parallel_size={tp} with a LoRA adapter on the LM head: the head is "
                                  "sliced by vocabulary rows and never called as a module; leave it out of "
                                  "model.lora_target_modules or set actor.tensor_parallel_size=1")
    matched = 0
    for name, module in list(base.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if lora.is_lora_layer(module):  # peft's wrapper under the projection's name: slice it whole
            if style not in ("colwise", "rowwise") or not isinstance(module.get_base_layer(), torch.nn.Linear):
                raise TensorParallelError(f"actor.tensor_parallel_size={tp}: a LoRA adapter on {name} (tp style "
                                          f"{style}) is not implemented; leave it out of model.lora_target_modules")
            _parallelize_lora(module, tp_mesh, style)
        else:
            trainable = {n: p.requires_grad for n, p in module.named_parameters()}
            parallelize_module(module, tp_mesh, styles[style]())
            for n, p in module.named_parameters():  # SequenceParallel's replicas come back trainable
                p.requires_grad_(trainable[n])  # (a frozen reference's Qwen3 q/k norms would train)
        matched += 1
    if not matched:
        raise TensorParallelError(f"actor.tensor_parallel_size={tp}: no module of {type(model).__name__} matches its "
                                  f"tensor-parallel plan {sorted(plan)}; set actor.tensor_parallel_size=1")
    tied = head is not None and head.weight is embedding.weight
    # vocabulary rows: the embedding looks up its own rows (masked, then all-reduced)
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if tied:  # the same rows of the same parameter
        head.weight = embedding.weight
    elif head is not None:
        head.weight = torch.nn.Parameter(_rows(head.weight, tp_mesh, Shard(0)), requires_grad=head.weight.requires_grad)


def _rows(weight: torch.Tensor, mesh, placement):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(weight.detach(), mesh, [placement])


def _parallelize_lora(layer: torch.nn.Module, tp_mesh, style: str) -> None:
    """A peft LoRA layer over a `style` projection sliced as one unit: the projection style's
    input and output hooks on the wrapper, its partition on the base layer and on each adapter's
    sliced factor (colwise: B by output rows; rowwise: A by input columns); `distribute_module`
    replicates the other factor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        unit, sliced, desired = ColwiseParallel(), "lora_B", (Replicate(),)
    else:  # rowwise: the input is this rank's slice of the features
        unit, sliced, desired = RowwiseParallel(), "lora_A", (Shard(-1),)

    def partition(name: str, module: torch.nn.Module, mesh) -> None:
        if name == "base_layer" or name.startswith(sliced + "."):
            unit._partition_linear_fn(name, module, mesh)

    distribute_module(layer, tp_mesh, partition,
                      partial(unit._prepare_input_fn, unit.input_layouts, desired),
                      partial(unit._prepare_output_fn, unit.output_layouts, unit.use_local_output))
