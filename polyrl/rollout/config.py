"""Rollout configuration: which engine, where it runs, and how it samples.

A config leaf: it imports only the config machinery at module level; the validators read the
backend list (polyrl/backends.py, layer 0) when they run. Which topology `placement` selects,
and what that allows, is decided in polyrl/distributed/topologies.py and checked by the job schema
(polyrl/job.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polyrl.config import Config
from polyrl.config.vocabulary import canonical_placement


class RolloutConfig(Config):
    backend: str = "native"
    """Rollout engine: native (the built-in PyTorch engine, runs anywhere), vllm, sglang or
    trtllm (GPU engines), or a backend a plugin registered (`polyrl/backends.py`)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """Where the engine lives (docs/architecture.md, "Vocabulary"). colocated: one engine inside
    each policy rank's process, on its device; after each update the rank copies its weights
    into it (weights.transport=in_place) and it frees its KV cache while training.
    disaggregated: rollout.num_replicas replicas as Ray actors with devices of their own; new
    weights reach them through weights.transport: a bucketed broadcast from the trainer's
    weight-sync leader in sync mode (through shared memory on one host), the object store in
    async mode (trainer.mode=async, which requires disaggregated). The earlier values hybrid
    and standalone are accepted as aliases of colocated and disaggregated."""
    n: int = Field(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature for training rollouts (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass for training rollouts."""
    top_k: int = Field(-1, ge=-1)
    """Top-k filter for training rollouts (-1 disables)."""
    response_length: int = Field(512, ge=1)
    """Most tokens generated per response."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + response the engine accepts (default: max prompt + response length)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight and activation dtype."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences decoded together in one engine step."""
    num_replicas: int = Field(1, ge=1)
    """Rollout replicas (disaggregated placement)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices per rollout replica."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of device memory a GPU engine may take (KV cache included)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n samples of a prompt, few-shot headers).
    GPU engines: vLLM `enable_prefix_caching`, SGLang's radix cache, TRT-LLM block reuse."""
    enforce_eager: bool = False
    """GPU engines: run without CUDA graphs (faster start and less memory, slower decode)."""
    quantization: Literal["fp8"] | None = None
    """Roll out with block-wise FP8 weights (e4m3, 128x128 blocks, dynamic activation scales).
    There is no FP8 checkpoint on disk: weights arrive, quantized, with every weight sync (SGLang
    and TRT-LLM quantize on the sending side, vLLM on the receiving side). GPU engines only."""
    load_format: Literal["auto", "dummy"] | None = None
    """How a GPU engine gets its first weights: "auto" reads the checkpoint from disk, "dummy"
    allocates random weights that the first weight sync overwrites. Unset: "dummy" in colocated
    placement or with quantization=fp8, else "auto". Outside colocated placement "dummy" is turned
    into "auto" unless quantization=fp8 (nothing else would ever fill the weights)."""
    lora_mode: Literal["merged", "adapter"] = "merged"
    """How a LoRA policy (model.lora_rank > 0) reaches the engines. merged: every sync sends the
    full weights with the adapters folded in (works with every engine). adapter (vLLM only): the
    engine reads the base model from model.path once and every sync sends only the adapter
    tensors, which vLLM loads as a LoRA adapter that every request then uses (its LoRA kernels;
    max rank rollout.engine_kwargs.vllm.max_lora_rank, vLLM's default 16)."""
    update_bucket_mb: int = Field(512, ge=1)
    """Byte budget (MiB) of one piece of a weight update pushed into a GPU engine: a vLLM
    `load_weights` bucket, an SGLang tensor batch, a TRT-LLM IPC-handle flush."""
    engine_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Extra launch arguments per engine, e.g. {"vllm": {"enforce_eager": true}}; each key
    overrides polyrl's default of that name (`polyrl train --dry-run` shows the result). A null
    value is an error naming the key; `engine_kwargs.trtllm.kv_cache_config` is merged key by
    key; native takes its engine's own arguments only (max_prefill_tokens, prefix_cache_tokens,
    ...); `quantization: fp8` here is refused: use rollout.quantization=fp8."""
    val_temperature: float = Field(0.0, ge=0)
    """Sampling temperature for validation (0 = greedy)."""
    val_n: int = Field(1, ge=1)
    """Samples per validation prompt (pass@k uses k = val_n)."""
    batch_invariant: bool = False
    """Exactly on-policy (built-in engine only): the engine samples and the trainer recomputes
    log-probs with one batch-invariant forward (polyrl/rollout/native/invariant.py), so they are
    equal bit for bit whatever the batch, padding, packing or KV-cache layout, and
    `rollout/logprob_diff_max` is 0.0. Slower (docs/benchmarks.md "Batch-invariant mode");
    docs/algorithms.md "Exactly on-policy"."""

    @field_validator("placement", mode="before")
    @classmethod
    def _placement_name(cls, value: object) -> object:
        return canonical_placement(value, "rollout.placement")

    @field_validator("batch_invariant")
    @classmethod
    def _invariant_engine(cls, value: bool, info) -> bool:
        from polyrl.backends import capabilities, engines_that

        backend = info.data.get("backend")
        if value and backend is not None and not capabilities(backend).batch_invariant:
            raise ValueError(f"rollout.batch_invariant=true needs rollout.backend="
                             f"{' or '.join(engines_that('batch_invariant'))} (the trainer's batch-invariant "
                             f"forward); {backend} computes its own log-probs: use algorithm.off_policy instead")
        return value

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        from polyrl.backends import check_backend

        return check_backend(value)

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        from polyrl.backends import backend_names, capabilities, engines_that

        caps = capabilities(self.backend)
        unknown = set(self.engine_kwargs) - set(backend_names()) - {self.backend}  # an import path's own
        if unknown:
            raise ValueError(
                f"engine_kwargs has unknown engine(s) {sorted(unknown)}; "
                f"use {', '.join(backend_names())}"
            )
        if self.lora_mode == "adapter":
            if not caps.lora_adapters:
                raise ValueError(f"rollout.lora_mode=adapter needs rollout.backend="
                                 f"{' or '.join(engines_that('lora_adapters'))} (an engine serving LoRA adapters); "
                                 f"{self.backend} takes merged weights: unset rollout.lora_mode")
            if self.quantization is not None or self.load_format == "dummy":
                raise ValueError("rollout.lora_mode=adapter reads the base model from model.path and "
                                 "only adapters travel: unset rollout.quantization / rollout.load_format=dummy")
        if self.quantization == "fp8":
            if not caps.fp8:
                raise ValueError("rollout.quantization=fp8 needs a GPU engine: set rollout.backend to "
                                 f"{' or '.join(engines_that('fp8'))}, or unset rollout.quantization")
            if self.load_format == "auto":
                raise ValueError("rollout.quantization=fp8 has no FP8 checkpoint to read: its weights "
                                 "arrive with the first weight sync. Set rollout.load_format=dummy "
                                 "(or leave it unset)")
        return self
