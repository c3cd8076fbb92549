"""The trainer's side of `rollout.batch_invariant=true`: log-probs computed with the native
engine's batch-invariant arithmetic (polyrl/rollout/native/invariant.py), so they equal the
engine's sampled log-probs bit for bit, and every token's value is independent of the
micro-batch it lands in (padded or packed, any size, any rank).

`enable(model, dtype)` switches a Hugging Face Llama / Qwen2 / Qwen3 causal LM over, once, before
its training engine is built: each decoder layer's `forward` becomes `invariant.layer_forward`
over that layer's own parameters (called through the layer module, so FSDP2 still gathers its
shards and checkpointing still recomputes it), and `response_logprobs` (training/logprobs.py)
routes the model to `invariant_response_logprobs` below. The forward runs in `dtype` (the
engine's `rollout.dtype`): weights rounded to it at use (the same rounding as autocast and as the
engine's copy of them), residual stream in it, norms and attention in float32, logits in float32.
The backward is plain autograd through the same operations.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from polyrl.batch import MicroBatch
from polyrl.modeling import torch_dtype
from polyrl.rollout.native import invariant as inv
from polyrl.rollout.native.loader import ModelSpec, spec_from_config
from polyrl.training import moe_replay

_MARK = "_polyrl_batch_invariant"


def enable(model: torch.nn.Module, dtype: str | torch.dtype) -> None:
    """Compute `model`'s log-probs with the batch-invariant forward in `dtype` from now on."""
    if hasattr(model, "peft_config"):
        raise ValueError("rollout.batch_invariant=true does not support LoRA policies (model.lora_rank > 0) "
                         "yet; set model.lora_rank=0 or rollout.batch_invariant=false")
    spec = spec_from_config(model.config)  # refuses architectures the engine does not run
    dtype = torch_dtype(dtype)
    for layer in model.model.layers:
        layer._polyrl_invariant = (spec, dtype)
        layer.forward = types.MethodType(_layer_forward, layer)
    setattr(model, _MARK, (spec, dtype))


def is_enabled(model: torch.nn.Module) -> bool:
    return getattr(model, _MARK, None) is not None


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def hf_layer_view(layer: torch.nn.Module, dtype: torch.dtype) -> inv.LayerView:
    """A Hugging Face decoder layer's parameters under the math's names, in `dtype`."""
    at, mlp = layer.self_attn, layer.mlp
    c = functools.partial(_cast, dtype=dtype)
    q_norm, k_norm = getattr(at, "q_norm", None), getattr(at, "k_norm", None)
    return inv.LayerView(
        input_norm=c(layer.input_layernorm.weight),
        q=c(at.q_proj.weight), k=c(at.k_proj.weight), v=c(at.v_proj.weight),
        q_bias=c(at.q_proj.bias), k_bias=c(at.k_proj.bias), v_bias=c(at.v_proj.bias),
        q_norm=None if q_norm is None else c(q_norm.weight), k_norm=None if k_norm is None else c(k_norm.weight),
        o=c(at.o_proj.weight), o_bias=c(at.o_proj.bias),
        post_norm=c(layer.post_attention_layernorm.weight),
        **(_experts_view(mlp, c) if hasattr(mlp, "experts") else dict(
            gate=c(mlp.gate_proj.weight), up=c(mlp.up_proj.weight),
            gate_bias=c(mlp.gate_proj.bias), up_bias=c(mlp.up_proj.bias),
            down=c(mlp.down_proj.weight), down_bias=c(mlp.down_proj.bias))),
    )


def _experts_view(mlp: torch.nn.Module, c) -> dict:
    """A Qwen3-MoE / Qwen2-MoE sparse block's tensors (invariant.ExpertsView), no dense MLP."""
    shared = getattr(mlp, "shared_expert", None)
    moe = inv.ExpertsView(
        router=c(mlp.gate.weight), gate_up=c(mlp.experts.gate_up_proj), down=c(mlp.experts.down_proj),
        shared_gate=None if shared is None else c(shared.gate_proj.weight),
        shared_up=None if shared is None else c(shared.up_proj.weight),
        shared_down=None if shared is None else c(shared.down_proj.weight),
        shared_expert_gate=None if shared is None else c(mlp.shared_expert_gate.weight))
    return dict(gate=None, up=None, gate_bias=None, up_bias=None, down=None, down_bias=None, moe=moe)


def _routing(layer: torch.nn.Module, tokens: int):
    """A mixture-of-experts layer's `invariant.Choose`: routing replay, its metrics and the
    load-balancing loss (training/moe_replay.py) over the micro-batch's `tokens` real rows (the
    rows past them pad the tiles and keep their own routes); None without a replay installed."""
    router = getattr(getattr(layer, "mlp", None), "gate", None)
    state = getattr(router, "_polyrl_state", None)
    if state is None:
        return None

    def choose(ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        chosen = state.routed(router._polyrl_layer, ids[:tokens], probs[:tokens])
        return torch.cat([chosen, ids[tokens:]])
    return choose


def _layer_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
                   tokens: int = 0) -> torch.Tensor:
    spec, dtype = self._polyrl_invariant
    choose = _routing(self, tokens)

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        with inv.serial():  # also when gradient checkpointing recomputes it inside the backward
            return inv.layer_forward(spec, hf_layer_view(self, dtype), x, cos, sin, attention, choose)

    # transformers checkpoints the class's `forward`, which this instance attribute replaces
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        return self._gradient_checkpointing_func(run, x, cos, sin)
    return run(x, cos, sin)


def _segments(mb: MicroBatch) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """(start, length) of every sample among the micro-batch's flattened rows, and each row's
    position in its sample (padding rows: 0)."""
    b, T = mb.input_ids.shape
    device = mb.input_ids.device
    if getattr(mb, "cu_seq_lens", None) is not None:  # one packed row (polyrl/batch/packed.py)
        bounds = mb.cu_seq_lens.tolist()
        segments = [(s, e - s) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        positions = torch.zeros(b * T, dtype=torch.long, device=device)
        for s, n in segments:
            positions[s:s + n] = torch.arange(n, device=device)
        return segments, positions
    lengths = mb.attention_mask.sum(1).tolist()  # right-padded rows (polyrl/batch/micro.py)
    segments = [(i * T, int(n)) for i, n in enumerate(lengths) if n > 0]
    return segments, torch.arange(T, device=device).repeat(b)


def invariant_response_logprobs(model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False,
                                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` (training/logprobs.py) of a model switched by `enable`."""
    spec, dtype = getattr(model, _MARK)
    trunk = model.model
    b, T = mb.input_ids.shape
    device = mb.input_ids.device
    segments, positions = _segments(mb)
    attention = functools.partial(_self_attention, spec, segments=segments)
    moe_replay.begin(model, mb)  # mixture-of-experts: the routes to replay, as response_logprobs does
    with torch.autocast(device.type, enabled=False), inv.serial():
        x = inv.pad_rows(F.embedding(mb.input_ids.reshape(-1), trunk.embed_tokens.weight.to(dtype)))
        cos, sin = inv.rope(spec, F.pad(positions, (0, x.shape[0] - positions.shape[0])), dtype)
        for layer in trunk.layers:
            x = layer(x, cos, sin, attention, b * T)
        moe_replay.end(model, mb)
        R = mb.target_ids.shape[1]
        real = torch.arange(R, device=device).unsqueeze(0) < mb.response_lengths.to(device).unsqueeze(1)
        offset = 0 if getattr(mb, "cu_seq_lens", None) is not None else (
            torch.arange(b, device=device).unsqueeze(1) * T)
        rows = (mb.gather_index + offset)[real]
        head = model.get_output_embeddings().weight.to(dtype)
        logp_all = inv.token_logprobs(x[rows], trunk.norm.weight.to(dtype), head, spec.rms_norm_eps)
        lp = logp_all.gather(1, mb.target_ids[real].unsqueeze(1)).squeeze(1)
        logprobs = lp.new_zeros(b, R).masked_scatter(real, lp)
        entropy = None
        if with_entropy or entropy_grad:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = -(logp_all.exp() * logp_all).sum(-1)
            entropy = ent.new_zeros(b, R).masked_scatter(real, ent)
    return logprobs, entropy


def _self_attention(spec: ModelSpec, q, k, v, *, segments):
    return inv.self_attention(spec, q, k, v, segments, spec.head_dim**-0.5)
