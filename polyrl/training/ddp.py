"""Data-parallel training with a full model replica per rank (actor.strategy=ddp).

Gradients are summed with one flat all-reduce per optimizer step rather than torch's
DistributedDataParallel hooks: the loss of each micro-batch is already its share of the global
mean (aggregation over the global token / sequence count), so a plain sum of gradients is the
global gradient, and ranks with no samples in a step still join the collective with zeros. Under
sequence parallelism (ulysses.py) each rank's gradient is its tokens' share, so the sum runs over
the data-parallel and sequence-parallel ranks (training/mesh.py `gradient_group`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from polyrl.batch import Ragged, RolloutBatch, scatter_rows
from polyrl.batch.packed import collate_layout, plan_layout
from polyrl.platform import Platform
from polyrl.training.base import MicroBatch, NonFiniteUpdate, StepResult
from polyrl.training import batch_invariant, compiled, lora, ulysses
from polyrl.training.lora import merged_named_weights
from polyrl.training.logprobs import response_logprobs
from polyrl.training.varlen import setup_packing
from polyrl.training.config import ActorConfig
from polyrl.training.mesh import ParallelDims, unplanned_mesh
from polyrl.training.mesh_groups import mesh_groups
from polyrl.training.optim import build_optimizer
from polyrl.training.vlm import is_vlm_config
from polyrl.weights.base import WeightStream

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class DDPEngine:
    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, platform: Platform,
                 device: torch.device, *, rank: int = 0, world_size: int = 1, group=None,
                 horizon: int | None = None, head: Callable = response_logprobs,
                 mesh: ParallelDims | None = None):
        """`horizon`: the run's length in optimizer steps; None builds a frozen engine (a
        reference policy: no gradients, no optimizer state). `head(model, mb, ...)` gives the
        per-token outputs: log-probs (+ entropy) of a policy, or a critic's values. `mesh`: the
        ranks' layout, the plan's in a run (`RolePlan.mesh`); an engine built outside a run lays
        `world_size` ranks out by its config (training/mesh.py `unplanned_mesh`)."""
        self._init_common(model, cfg, platform, device, rank=rank, world_size=world_size, group=group,
                          horizon=horizon, head=head, mesh=mesh)
        if horizon is not None:
            self.optimizer, self.scheduler = build_optimizer(model.parameters(), cfg, horizon)
        # actor.compile (training/compiled.py): the head traced through the model, backward included
        # a model on the batch-invariant forward (training/batch_invariant.py) runs it eagerly
        invariant = batch_invariant.is_enabled(self.module)
        if invariant and cfg.compile == "on":
            raise ValueError("actor.compile=on: the batch-invariant forward (rollout.batch_invariant=true) "
                             "runs eagerly; set actor.compile=auto or off")
        # a vision-language model's first compiled update took 386 s against 2.5 s eager on 2 cores
        # (the tower's shapes change per batch): auto leaves it eager, on is the user's choice
        mode = "off" if cfg.compile == "auto" and is_vlm_config(getattr(self.module, "config", None)) else cfg.compile
        self.compiled = not invariant and self.sp is None and compiled.should_compile(
            mode, device=device, compute_dtype=self.compute_dtype, horizon=horizon, lora=self.lora,
            gradient_checkpointing=cfg.gradient_checkpointing)
        self._run_head = compiled.compile_head(head) if self.compiled else head
        self._compile_clock = compiled.compile_seconds() if self.compiled else 0.0
        self._setup_packing()

    def _init_common(self, model: torch.nn.Module, cfg: ActorConfig, platform: Platform, device: torch.device,
                     *, rank: int, world_size: int, group, horizon: int | None, head: Callable,
                     mesh: ParallelDims | None) -> None:
        """What every engine sets up alike (fsdp2.py too): the model and its LoRA wrapper, the
        mesh's process groups, train or frozen mode."""
        self.head = head
        # LoRA (training/lora.py): the optimizer sees only the adapters; the head runs on the
        # adapted model itself, not peft's wrapper
        self.lora = lora.is_lora(model)
        self.module = model.get_base_model() if self.lora else model
        self.model, self.cfg, self.platform, self.device = model, cfg, platform, device
        self.num_params = sum(p.numel() for p in model.parameters())
        self.nonfinite_in_a_row = 0
        self.optimizer = self.scheduler = None
        self.compute_dtype = torch.bfloat16 if cfg.compute_dtype == "bfloat16" else torch.float32
        dims = mesh or unplanned_mesh(cfg, world_size)
        self.mesh = mesh_groups(dims, group)
        self.rank = rank
        self.world_size = dims.data_parallel_size
        """Ranks with different samples: what sums over samples (`all_reduce`) run over."""
        self.group = self.mesh.data
        self.gradient_ranks, self.gradient_group = dims.gradient_parallel_size, self.mesh.gradient
        self.sp = self.mesh.sequence
        if self.sp is not None:
            ulysses.check_heads(self.module, self.sp.size, dims.tp)  # tp: each rank splits its own heads
            if batch_invariant.is_enabled(self.module):
                raise ValueError("actor.sequence_parallel_size > 1 cannot compute log-probs on the batch-invariant "
                                 "forward (rollout.batch_invariant=true); set one of them off")
        if horizon is None:
            model.eval().requires_grad_(False)
        else:
            model.train()

    def _setup_packing(self) -> None:
        """`actor.packing` for this engine; sequence parallelism splits packed rows, so it packs
        every micro-batch (of the critic too, whose head reads packed rows only then)."""
        on = "on" if self.sp is not None else self.cfg.packing
        self.packing = setup_packing(self.module, on, compiled=self.compiled,
                                     head_reads_packed=self.head is response_logprobs or self.sp is not None)

    def _collate(self, batch: RolloutBatch, indices: list[int], packed: bool) -> MicroBatch:
        """One micro-batch on this engine's device, cut to this rank's tokens under sequence
        parallelism (training/ulysses.py)."""
        mb = collate_layout(batch, indices, self.device, packed)
        return mb if self.sp is None else ulysses.shard_micro_batch(mb, self.sp)

    # --- forward / backward -----------------------------------------------------------------------
    def forward(self, mb: MicroBatch, with_entropy: bool = False,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                  enabled=self.compute_dtype == torch.bfloat16)
        with autocast, self.platform.training_attention(self.compute_dtype):
            return self._run_head(self.module, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def micro_batches(self, batch: RolloutBatch) -> Iterator[MicroBatch]:
        """`batch` cut into micro-batches of `actor.micro_batch_tokens`, padded or packed as
        `actor.packing` resolved for this engine (polyrl/batch/packed.py)."""
        packed, plan = plan_layout(batch.lengths, self.cfg.micro_batch_tokens, self.packing)
        for idx in plan:
            yield self._collate(batch, idx, packed)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> Ragged:
        """The head's output for every response token of `batch` (log-probs; a critic's values)."""
        was_training = self.model.training
        self.model.eval()
        out = Ragged.full_like(batch.response_ids, 0.0, torch.float32)
        for mb in self.micro_batches(batch):
            lp, _ = self.forward(mb)
            scatter_rows(out, mb, lp.float().cpu())
        self.model.train(was_training)
        return out

    # --- optimizer ---------------------------------------------------------------------------------
    def optimizer_step(self, loss_value: float) -> StepResult:
        """Sum gradients over the ranks, clip, and step; a NaN/inf loss or gradient drops the
        update (counted; `actor.max_nonfinite_steps` in a row stop the run)."""
        grad_norm = self._reduce_and_clip()
        lr = self.scheduler.get_last_lr()[0]
        compile_s = self._compile_time_since_last_step()
        if not math.isfinite(grad_norm) or not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                raise NonFiniteUpdate(
                    f"{self.nonfinite_in_a_row} updates in a row had a NaN/inf loss or gradient "
                    f"(each was skipped); stopping. Lower actor.lr, enable actor.grad_clip, or "
                    f"check the rewards. Last loss={loss_value}, grad_norm={grad_norm}")
            return StepResult(grad_norm, True, lr, compile_s)
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.scheduler.step()  # a skipped update is not a step of the schedule
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm, False, lr, compile_s)

    def _compile_time_since_last_step(self) -> float | None:
        """Seconds spent compiling since the previous optimizer step (this step's forwards and
        backwards, and the log-probs computed before them), None when nothing compiled."""
        if not self.compiled:
            return None
        now = compiled.compile_seconds()
        spent, self._compile_clock = now - self._compile_clock, now
        return spent if spent > 0 else None

    def _reduce_and_clip(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # a rank with no samples this step still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.gradient_ranks > 1:  # sum of shares (of samples and of tokens) = the global loss's gradient
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.gradient_group)
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
        max_norm = self.cfg.grad_clip or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    # --- weights and checkpoints --------------------------------------------------------------------
    @torch.no_grad()
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora:  # full Hugging Face-named weights with the adapters folded in
            yield from merged_named_weights(self.model)
        else:
            yield from self.model.named_parameters()

    def weight_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """Name, shape and dtype of every tensor named_weights() yields, known before any is
        produced (merged LoRA weights included)."""
        if self.lora:
            return lora.merged_weight_specs(self.model)
        return [(name, p.shape, p.dtype) for name, p in self.model.named_parameters()]

    def weight_stream(self) -> WeightStream:
        """named_weights() with its specs: what a weight transport sends without holding it."""
        return WeightStream(self.weight_specs(), self.named_weights(), device=self.device)

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapter tensors alone (lora.adapter_named_tensors), for an engine that
        applies the adapter itself (rollout.lora_mode=adapter)."""
        if not self.lora:
            raise ValueError("rollout.lora_mode=adapter needs a LoRA policy (model.lora_rank > 0)")
        yield from lora.adapter_named_tensors(self.model)

    def adapter_stream(self) -> WeightStream:
        return WeightStream(lora.adapter_specs(self.model), self.adapter_tensors(), device=self.device)

    def save(self, directory: Path) -> None:
        """Rank 0: the model in Hugging Face format (`policy/`); every rank: its optimizer state."""
        if self.rank == 0 and self.lora:  # the merged model (usable as model.path) + the adapter
            lora.export(self.model, directory / "policy")
            lora.save_adapter(self.model, directory / lora.ADAPTER_DIR)
        elif self.rank == 0:
            self.model.save_pretrained(str(directory / "policy"), safe_serialization=True)
        if self.optimizer is not None:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "nonfinite_in_a_row": self.nonfinite_in_a_row}, directory / f"engine_rank{self.rank}.pt")

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        if self.lora:
            lora.load_adapter(self.model, directory / lora.ADAPTER_DIR)
            self._load_optimizer(directory)
            return
        state = {}
        for f in sorted((directory / "policy").glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # tied embeddings are saved once; anything else missing means another model
        missing = [m for m in missing if not _tied(self.model, m)]
        if missing or unexpected:
            raise ValueError(f"checkpoint {directory} holds another model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]} (resume with the model it was written for)")
        self._load_optimizer(directory)

    def _load_optimizer(self, directory: Path) -> None:
        if self.optimizer is not None:
            saved = torch.load(directory / f"engine_rank{self.rank}.pt", weights_only=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.nonfinite_in_a_row = saved["nonfinite_in_a_row"]


def _tied(model: torch.nn.Module, name: str) -> bool:
    """`name` is a parameter tied to another one (saved under the other's name)."""
    tied = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(tied, dict):
        tied = list(tied)
    return name in tied and bool(getattr(model.config, "tie_word_embeddings", False))
