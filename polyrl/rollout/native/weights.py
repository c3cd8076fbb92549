"""The engine's own weight layout, and the map from Hugging Face parameter names into it.

q/k/v and gate/up are fused into one matrix each, so a decode step issues 4 matmuls per layer
instead of 7: on a CPU the per-call overhead is a large share of a small model's step. Every HF
name maps to a *view* of a fused tensor, so loading from disk and `update_weights` are the same
copy, and an update never reallocates (views stay valid, nothing else needs to know).

A vision-language model's vision tower (transformers' module, vision.py) registers its
parameters in the same map under `visual.*`, so it is loaded and updated by the same checked,
all-or-nothing copy; names in transformers 5's in-memory form (`model.language_model.*`,
`model.visual.*`) are renamed to the saved form first (`vision.canonical_name`).

The forward reads the matrices through `compute`: for fp32 on a CPU a prepacked copy of each (see
`matmul.py`), rebuilt after every load or update and swapped in as one object, elsewhere the
plain tensors themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from polyrl.rollout.base import WeightUpdateError
from polyrl.rollout.native.loader import ModelSpec
from polyrl.rollout.native.matmul import PlainMatmul, matmul_for
from polyrl.rollout.native.moe import (MoeWeights, fold_expert_names, moe_targets, new_moe_weights, packed_moe,
                                       required_moe_names)
from polyrl.rollout.native.vision import build_vision_tower, canonical_name, tower_targets

logger = logging.getLogger(__name__)

# Buffers some checkpoints carry that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [num_heads + num_kv_heads, head_dim]: q_norm then k_norm rows
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    moe: MoeWeights | None = None
    """A mixture-of-experts layer's router and experts (moe.py), in place of gate_up / down."""


@dataclass(frozen=True)
class ComputeWeights:
    """What the forward multiplies by: layers whose qkv / o / gate_up / down (and the lm_head) are
    in the matmul implementation's format; norms and biases are the plain tensors."""

    layers: list[LayerWeights]
    lm_head: torch.Tensor
    matmul: PlainMatmul  # the implementation that reads these tensors (or a subclass)

    @property
    def num_packed(self) -> int:
        """Matrices held in oneDNN's blocked layout (the others are plain tensors)."""
        mats = [m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down) if m is not None] + [self.lm_head]
        return sum(m.is_mkldnn for m in mats)


class ModelWeights:
    """Fused parameters plus `targets`: HF name -> (view to copy into, expected shape)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, *, batch_hint: int = 64,
                 pack: bool = True):
        self.spec = spec
        H, V, I = spec.hidden_size, spec.vocab_size, spec.intermediate_size
        q, kv, hd = spec.q_size, spec.kv_size, spec.head_dim

        def new(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.embed = new(V, H)
        self.final_norm = new(H)
        self.lm_head = self.embed if spec.tie_word_embeddings else new(V, H)
        self._add("model.embed_tokens.weight", self.embed)
        self._add("model.norm.weight", self.final_norm)
        # A tied checkpoint may still list lm_head.weight; it lands in the shared embedding.
        self._add("lm_head.weight", self.lm_head)

        self.layers: list[LayerWeights] = []
        self._expert_aliases: set[str] = set()
        """Per-expert names of a saved checkpoint: a second spelling of the fused experts (moe.py)."""
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            sparse = spec.moe is not None and spec.moe.sparse_layers[i]
            lw = LayerWeights(
                input_norm=new(H),
                qkv=new(q + 2 * kv, H),
                qkv_bias=new(q + 2 * kv) if spec.qkv_bias else None,
                qk_norm=new(spec.num_heads + spec.num_kv_heads, hd) if spec.qk_norm else None,
                o=new(H, q),
                o_bias=new(H) if spec.o_bias else None,
                post_norm=new(H),
                gate_up=None if sparse else new(2 * I, H),
                gate_up_bias=new(2 * I) if spec.mlp_bias and not sparse else None,
                down=None if sparse else new(H, I),
                down_bias=new(H) if spec.mlp_bias and not sparse else None,
                moe=new_moe_weights(spec.moe, H, new) if sparse else None,
            )
            self.layers.append(lw)
            self._add(p + "input_layernorm.weight", lw.input_norm)
            self._add(p + "post_attention_layernorm.weight", lw.post_norm)
            att, mlp = p + "self_attn.", p + "mlp."
            for name, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                self._add(f"{att}{name}_proj.weight", lw.qkv[lo:hi])
                if lw.qkv_bias is not None:
                    self._add(f"{att}{name}_proj.bias", lw.qkv_bias[lo:hi])
            self._add(att + "o_proj.weight", lw.o)
            if lw.o_bias is not None:
                self._add(att + "o_proj.bias", lw.o_bias)
            if lw.qk_norm is not None:
                # One per-head weight broadcast over all heads: copy_ broadcasts [hd] -> [heads, hd].
                self._add(att + "q_norm.weight", lw.qk_norm[: spec.num_heads], (hd,))
                self._add(att + "k_norm.weight", lw.qk_norm[spec.num_heads :], (hd,))
            if sparse:
                fused = required_moe_names(mlp, spec.moe)
                for name, view in moe_targets(mlp, lw.moe, spec.moe).items():
                    self._add(name, view)
                    if name not in fused:
                        self._expert_aliases.add(name)
                continue
            self._add(mlp + "gate_proj.weight", lw.gate_up[:I])
            self._add(mlp + "up_proj.weight", lw.gate_up[I:])
            self._add(mlp + "down_proj.weight", lw.down)
            if lw.gate_up_bias is not None:
                self._add(mlp + "gate_proj.bias", lw.gate_up_bias[:I])
                self._add(mlp + "up_proj.bias", lw.gate_up_bias[I:])
                self._add(mlp + "down_proj.bias", lw.down_bias)
        self.visual = None
        """transformers' vision tower of a vision-language model (vision.py), else None."""
        if spec.vision is not None:
            self.visual = build_vision_tower(spec.vision, dtype, torch.device(device))
            for name, tensor in tower_targets(self.visual).items():
                self._add(name, tensor)
        # pack=False: plain F.linear on the plain tensors (the batch-invariant forward reads them)
        self.matmul = matmul_for(self.embed, batch_hint) if pack else PlainMatmul()
        self.compute = self._compute_weights()

    def _compute_weights(self) -> ComputeWeights:
        """New packed copies of every matrix (the plain tensors when the matmul does not pack)."""
        pack = self.matmul.pack
        layers = [replace(lw, qkv=pack(lw.qkv), o=pack(lw.o), gate_up=lw.gate_up if lw.moe else pack(lw.gate_up),
                          down=lw.down if lw.moe else pack(lw.down),
                          moe=lw.moe and packed_moe(lw.moe, self.matmul))
                  for lw in self.layers]
        return ComputeWeights(layers, pack(self.lm_head), self.matmul)

    def _add(self, name: str, view: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
        self.targets[name] = (view, tuple(view.shape) if shape is None else shape)

    def canonical(self, name: str) -> str:
        """`name` in this map's naming (a vision-language model's names come in two forms)."""
        return canonical_name(name) if self.visual is not None else name

    def required_names(self) -> set[str]:
        names = set(self.targets) - self._expert_aliases
        if self.spec.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def covers(self, names) -> bool:
        """Whether `names` (in either naming) write every required weight."""
        return self.required_names() <= self.written({self.canonical(n) for n in names})

    def written(self, names: set[str]) -> set[str]:
        """`names` (canonical) with complete per-expert sets counted as the fused experts they fill."""
        if self.spec.moe is None:
            return names
        for i, sparse in enumerate(self.spec.moe.sparse_layers):
            if sparse:
                names = fold_expert_names(names, f"model.layers.{i}.mlp.", self.spec.moe)
        return names

    def validate(self, named_tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Check every name and shape before anything is written; returns (destination, source)."""
        plan = []
        for name, tensor in named_tensors.items():  # errors name the tensor as it was given
            target = self.canonical(name)
            if target.endswith(_IGNORED_SUFFIXES):
                continue
            if target not in self.targets:
                raise WeightUpdateError(
                    f"unknown parameter '{name}' for {self.spec.architecture} "
                    f"(expected Hugging Face names like 'model.layers.0.self_attn.q_proj.weight')"
                )
            view, shape = self.targets[target]
            if not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"parameter '{name}': expected a tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != shape:
                raise WeightUpdateError(
                    f"parameter '{name}': shape {tuple(tensor.shape)} does not match the model's {shape}"
                )
            if not (tensor.is_floating_point()):
                raise WeightUpdateError(f"parameter '{name}': dtype {tensor.dtype} is not floating point")
            plan.append((view, tensor))
        return plan

    @torch.no_grad()
    def apply(self, plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for view, tensor in plan:
            view.copy_(tensor)
        self._repack()

    def plan_stream(self, specs: Any) -> dict[str, torch.Tensor]:
        """Where each tensor of a `WeightStream` (polyrl/weights/base.py) goes, from its specs:
        every name and shape is checked before the first tensor is produced."""
        dests = {}
        for spec in specs:
            plan = self.validate({spec.name: torch.empty(spec.shape, dtype=spec.dtype, device="meta")})
            if plan:
                dests[spec.name] = plan[0][0]
        return dests

    @torch.no_grad()
    def load_stream(self, dests: dict[str, torch.Tensor], stream: Any) -> None:
        """Copy each tensor as it arrives and drop it, so the sender never holds more than one.
        A stream that fails midway has overwritten part of the weights: the caller must not
        serve them."""
        tensors = iter(stream)
        while True:
            # the producer (an FSDP2 gather, a LoRA merge) runs in the trainer's autograd mode,
            # not in the inference mode the engine's own tensors need
            with torch.inference_mode(False):
                item = next(tensors, None)
            if item is None:
                break
            name, tensor = item
            del item
            dest = dests.get(name)
            if dest is not None:
                dest.copy_(tensor)
            del tensor  # before the next one is produced
        self._repack()

    def _repack(self) -> None:
        if self.matmul.packs:
            try:
                compute = self._compute_weights()
            except RuntimeError as exc:  # e.g. out of memory for the packed copy: stay correct, unpacked
                logger.warning("native engine: packing the weights failed (%s); continuing with plain "
                               "F.linear, which is slower on this CPU (health() reports 'matmul')", exc)
                self.matmul = PlainMatmul()
                compute = self._compute_weights()
            self.compute = compute  # one swap: a forward sees all old or all new matrices

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, device,
        *, batch_hint: int = 64, pack: bool = True,
    ) -> ModelWeights:
        weights = cls(spec, dtype, torch.device(device), batch_hint=batch_hint, pack=pack)
        missing = sorted(weights.required_names() - weights.written({weights.canonical(n) for n in state_dict}))
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"native engine: checkpoint is missing parameters: {shown}")
        weights.apply(weights.validate(state_dict))
        return weights

    def num_matmul_params(self) -> int:
        """Parameters multiplied per generated token (embedding lookup excluded, lm_head included)."""
        total = self.lm_head.numel()
        for lw in self.layers:
            total += lw.qkv.numel() + lw.o.numel()
            if lw.moe is None:
                total += lw.gate_up.numel() + lw.down.numel()
            else:  # the router, k of the experts and the shared expert: the active parameters
                k, E = self.spec.moe.top_k, self.spec.moe.num_experts
                experts = (lw.moe.gate_up.numel() + lw.moe.down.numel()) * k // E
                total += sum(t.numel() for t in lw.moe.matrices()) - lw.moe.gate_up.numel() - lw.moe.down.numel() + experts
        return total
