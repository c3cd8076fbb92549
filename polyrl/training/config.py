"""Configuration of the model and of the policy-training workers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from polyrl.config import Config
from polyrl.training.lora_config import LoraConfig

BUILTIN_MODEL = "builtin:tiny-arith"


class ModelConfig(LoraConfig):
    path: str = BUILTIN_MODEL
    """Local Hugging Face model directory (config.json, safetensors, tokenizer files), or
    builtin:tiny-arith for the bundled tiny model (builtin:tiny-calc: its tool-calling sibling,
    docs/tools_calculator.md). Nothing is downloaded."""
    tokenizer_path: str | None = None
    """Tokenizer directory if it differs from `path`."""
    trust_remote_code: bool = False
    """Allow model code shipped in the model directory (transformers' trust_remote_code)."""
    train_vision_tower: bool = False
    """Vision-language models (Qwen2-VL, Qwen2.5-VL): train the vision encoder too. False keeps
    it frozen and LoRA's all-linear leaves it without adapters, so RL tunes the language model
    only (polyrl/training/vlm.py). No effect on a text-only model."""


class ActorConfig(Config):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warm-up: cosine / linear decay reach min_lr_ratio once the run's last
    optimizer step is taken (the horizon is trainer steps x ppo_epochs x mini-batches)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of `lr` for decaying schedules."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (null disables)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch of rollouts."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Prompts per optimizer step (default: the whole batch, i.e. one step per batch)."""
    micro_batch_tokens: int = Field(8192, ge=64)
    """Token budget of one forward/backward micro-batch (a sample longer than the budget gets one
    of its own). Padded (see `packing`): samples sorted by length are right-padded to the longest
    in their micro-batch, and rows x longest row stays within the budget. Packed: samples are
    concatenated into one row of at most this many real tokens, with no padding."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Sequence packing of the policy's micro-batches (the update and the log-prob passes; the
    critic and `polyrl sft` always pad). on: each micro-batch is one row of whole samples,
    positions restarting per sample and attention computed per sample
    (polyrl/training/varlen.py), so no padding is computed; off: right-padded rows. auto: packs
    a batch whose padded plan would be at least polyrl/batch/packed.py PACK_MIN_PADDING padding,
    the size rule measured in docs/benchmarks.md "Sequence packing" (packing pays on long-tail
    length mixes, not on near-uniform ones); off while the forward is compiled (`compile`) or
    for a model whose attention is not SDPA or uses sliding windows (on: an error naming why)."""
    world_size: int = Field(1, ge=1)
    """Policy ranks (torch.distributed: gloo on CPU, the platform's backend on GPUs)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks share the model: ddp replicates it and all-reduces gradients (one flat
    all-reduce per optimizer step); fsdp2 shards parameters, gradients and optimizer state per
    decoder layer over the ranks (PyTorch FSDP2; docs/training.md, "DDP or FSDP2")."""
    sequence_parallel_size: int = Field(1, ge=1)
    """Ranks that split each packed sequence along its tokens (DeepSpeed-Ulysses: an all-to-all
    of attention heads around each attention layer, polyrl/training/ulysses.py), so a sequence k
    times longer trains at about the same activation memory per rank. Must divide world_size;
    the other world_size / k ways stay data parallel (the mesh: polyrl/training/mesh.py). Needs
    packed micro-batches (actor.packing auto or on; auto always packs under it) and a model whose
    attention heads and key-value heads divide by k (docs/training.md, "Sequence parallelism")."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that split every attention and MLP projection, and the vocabulary, of each layer
    (torch.distributed.tensor.parallel on the model's own tensor-parallel plan,
    polyrl/training/tensor_parallel.py), so each rank holds and computes about 1/k of the model
    on the same samples. Needs actor.strategy=fsdp2, which shards each slice over the other
    world_size / k ranks (a 2-D mesh), and a model whose attention heads, key-value heads and
    MLP width divide by k (docs/training.md, "Tensor parallelism")."""
    expert_parallel_size: int = Field(1, ge=1)
    """Mixture-of-experts policies: data-parallel ranks that split every MoE layer's experts
    (each holds num_experts / k of them; tokens travel to their experts by an all-to-all,
    polyrl/training/expert_parallel.py). Needs actor.strategy=fsdp2, which shards the experts over
    the other world_size / k data ranks; must divide world_size and the model's num_experts
    (docs/moe.md, "Expert parallelism")."""
    offload: bool = False
    """fsdp2 only: keep the parameter shards and optimizer state in host memory, moving each
    layer to the device for its forward/backward (no effect on a CPU platform)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weights and optimizer dtype."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Autocast dtype of forward/backward."""
    num_cpus_per_worker: int | None = Field(None, ge=1)
    """CPUs each Ray actor of the run reserves and torch threads it runs: every policy rank and
    every disaggregated rollout rank (replicas x tensor_parallel_size). Default: (cores of the
    machine that plans the job - 1) // (policy ranks + disaggregated rollout ranks), at least 1;
    set it for a cluster whose nodes differ from the machine you launch from."""
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    """Where the PPO ratio's old log-probs come from: auto uses the engine's when rollout is
    on-policy and the engine declares its log-probs equal to the trainer's in the run's dtype
    (docs/engine_plugins.md), else recomputes."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the policy forward."""
    router_replay: Literal["off", "R2", "R3"] = "off"
    """Mixture-of-experts policies (docs/moe.md): the experts the trainer's forward uses. off: its
    own router's top-k; R2: the routes of its own old-policy forward (the proximal log-prob pass
    of a multi-step update); R3: the routes the rollout engine sampled with (an engine that
    declares `routed_experts`). The router still computes its scores, and keeps its gradient."""
    router_aux_loss_coef: float = Field(0.0, ge=0.0)
    """Mixture-of-experts: weight of the load-balancing loss E * sum_e f_e * P_e (averaged over
    layers) added to the policy loss; 0 (the default) adds none."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """Stop after this many consecutive updates with NaN/inf loss or gradients (each skipped)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the training forward + backward (strategy=ddp): on, off, or auto = on only
    where measured to pay after its compile time (minutes on a CPU): a CPU platform,
    compute_dtype=bfloat16, no LoRA, no gradient checkpointing, not a vision-language model
    (docs/vision.md) and a run of at least
    polyrl/training/compiled.py AUTO_MIN_STEPS optimizer steps (docs/benchmarks.md, "Compiled step
    and weight casts"). Compile seconds are logged as perf/compile_s."""

    @model_validator(mode="after")
    def _offload_needs_shards(self) -> "ActorConfig":
        if self.offload and self.strategy != "fsdp2":
            raise ValueError(f"actor.offload=true needs actor.strategy=fsdp2 ({self.strategy} keeps the "
                             "whole model on the device); set actor.strategy=fsdp2 or actor.offload=false")
        return self

    @model_validator(mode="after")
    def _sequence_parallel_fits(self) -> "ActorConfig":
        k = self.sequence_parallel_size
        if k == 1:
            return self
        if self.packing == "off":  # that k divides the ranks is the mesh's check (`_mesh_fits`)
            raise ValueError(f"actor.sequence_parallel_size={k} splits packed rows: set actor.packing=auto or on")
        if self.compile == "on":
            raise ValueError(f"actor.sequence_parallel_size={k} runs eagerly: set actor.compile=auto or off")
        return self

    @model_validator(mode="after")
    def _mesh_fits(self) -> "ActorConfig":
        # the mesh's own checks, written once (training/mesh.py), before Ray starts; mesh.py is
        # pure arithmetic, imported when used so importing a config imports no layout code
        from polyrl.training.mesh import check_actor

        check_actor(self)
        return self

    @field_validator("compile", "packing", mode="before")
    @classmethod
    def _switch_from_yaml_bool(cls, value):
        # YAML reads a bare on / off (in a file or as actor.compile=on) as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _packing_not_compiled(self) -> "ActorConfig":
        if self.packing == "on" and self.compile == "on":
            raise ValueError("actor.packing=on cannot run under actor.compile=on (the packed attention loops "
                             "over each row's samples in Python); set one of them to off or auto")
        return self

    @model_validator(mode="after")
    def _replay_not_compiled(self) -> "ActorConfig":
        if self.router_replay != "off" and self.compile == "on":
            raise ValueError(f"actor.router_replay={self.router_replay} cannot run under actor.compile=on (the "
                             "replayed routes are set per micro-batch in Python); set actor.compile=auto or off")
        return self

    @model_validator(mode="after")
    def _compile_needs_ddp(self) -> "ActorConfig":
        if self.compile == "on" and self.strategy != "ddp":
            raise ValueError(f"actor.compile=on needs actor.strategy=ddp ({self.strategy} is not compiled); "
                             "set actor.compile=auto or off, or actor.strategy=ddp")
        return self

