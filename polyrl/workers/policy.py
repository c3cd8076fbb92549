"""The policy worker: one rank of policy training, with its colocated rollout engine.

Runs inside a Ray actor (a topology starts it with `ray.remote` and its `RolePlan`,
polyrl/distributed/role.py). The model is trained through a training engine (training/base.py;
`DDPEngine` for actor.strategy=ddp), the PPO update is `PPOActor` (actor.py), the reference
policy is a frozen engine. What the rank does besides training is its plan's, not the config's:
which world it joins, whether it hosts a colocated rollout engine (same process and device:
after each update the weights are copied into it in place, version-stamped, and its KV cache is
freed while training), whether it sends weights and over which transport.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polyrl.batch import Ragged, RolloutBatch
from polyrl.data.vision import copy_processor_files
from polyrl.distributed.layout import build_groups, group_leader
from polyrl.distributed.role import RolePlan
from polyrl.platform import get_platform
from polyrl.rollout.factory import build_colocated_engine, colocated_engine_streams
from polyrl.rollout.native.threads import FreeCoreThreads
from polyrl.training import batch_invariant, build_engine, sharded_load
from polyrl.training.lora import adapters_disabled, apply_lora
from polyrl.modeling import torch_dtype
from polyrl.training.values import load_value_model, response_values
from polyrl.workers.actor import PPOActor
from polyrl.workers.critic import CriticUpdate
from polyrl.rollout.base import SamplingParams
from polyrl.workers.generation import rollout_rows
from polyrl.training.model_loading import load_causal_lm, load_tokenizer, model_dir
from polyrl.training.optim import total_optimizer_steps
from polyrl.training.memory_floor import loads_sharded
from polyrl.workers.rollout_worker import open_transport
from polyrl.workers.teacher import teacher_engine, teacher_rollout
from polyrl.job import JobConfig

logger = logging.getLogger(__name__)


class PolicyWorker:
    def __init__(self, cfg: JobConfig, role: RolePlan, total_steps: int):
        self.cfg, self.role = cfg, role
        self.rank, self.world_size = role.index, cfg.actor.world_size
        self.total_steps = total_steps
        torch.set_num_threads(role.num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.claim_device()  # the Ray reservation's, made current
        # on a CPU the update runs on the cores that are free, at most role.num_threads (threads.py)
        self.threads = FreeCoreThreads() if self.device.type == "cpu" else None
        self.version = 0
        self.transport = None  # set by setup(); a shutdown during set-up finds none to close

    def address(self) -> str:
        """A rendezvous address on this worker's node (asked of rank 0 only)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, dist_init: str | None, mailbox: Any = None) -> int:
        cfg, rank, role = self.cfg, self.rank, self.role
        torch.manual_seed(cfg.trainer.seed + rank)
        train_group = self._join_process_groups(dist_init, mailbox)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
        # fsdp2: on the meta device, each rank reading its own shards (LoRA's base too), unless a
        # colocated engine must start from the whole module (the built-in engine); a GPU engine
        # starts from the training engine's first streamed sync instead
        streams = role.colocated_engine and colocated_engine_streams(cfg.rollout)
        model = self._load_model(deferred=loads_sharded(cfg.actor.strategy, role.colocated_engine,
                                                        cfg.model.enabled, engine_streams=streams))
        self.rollout_engine = None
        if role.colocated_engine and not sharded_load.is_deferred(model):  # from the plain model, before LoRA
            self.rollout_engine = build_colocated_engine(cfg.rollout, model, self.tokenizer, self.device,
                                                         seed=role.engine_seed, platform=self.platform)
            self.rollout_engine.sleep()
            self.transport = open_transport(role, cfg.weights, engine=self.rollout_engine)
        if cfg.model.enabled:  # LoRA: adapters on the policy; the frozen base is the reference
            model = apply_lora(model, cfg.model)
        if cfg.actor.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.world_size > 1 and not sharded_load.is_deferred(model):  # identical start on every
            # rank, whatever each rank's RNG did (a deferred model: every rank reads the same files)
            src = group_leader(train_group or dist.group.WORLD)
            for p in model.parameters():
                dist.broadcast(p.data, src=src, group=train_group)
        horizon = total_optimizer_steps(cfg.actor, self.total_steps, cfg.num_mini_batches)
        # the planned mesh (RolePlan.mesh): the engine's groups are the ones the driver shards for
        engine_args = dict(rank=rank, world_size=self.world_size, group=train_group, mesh=role.mesh)
        actor_cfg = cfg.actor
        if cfg.model.enabled:
            actor_cfg = actor_cfg.model_copy(update={"lr": cfg.actor.lr * cfg.model.lora_lr_scale})
        if cfg.rollout.batch_invariant:  # log-probs on the engine's batch-invariant forward
            batch_invariant.enable(model, cfg.rollout.dtype)
        self.engine = build_engine(model, actor_cfg, self.platform, self.device, horizon=horizon, **engine_args)
        self.engine.piece_bytes = cfg.weights.bucket_bytes  # the sync's row slices, alike on every rank
        if role.colocated_engine and self.rollout_engine is None:  # sharded: every rank, the same gathers
            self.rollout_engine = build_colocated_engine(cfg.rollout, model, self.tokenizer, self.device,
                                                         seed=role.engine_seed, platform=self.platform,
                                                         first_weights=self.engine.weight_stream())
            self.rollout_engine.sleep()
            self.transport = open_transport(role, cfg.weights, engine=self.rollout_engine)
        self.reference = None
        if cfg.algorithm.uses_reference and not cfg.model.enabled:  # frozen: no grads, no optimizer
            reference = self._load_model(deferred=True)
            if cfg.rollout.batch_invariant:
                batch_invariant.enable(reference, cfg.rollout.dtype)
            self.reference = build_engine(reference, cfg.actor, self.platform, self.device, **engine_args)
        self.teacher = None
        if role.holds_teacher:  # distill.placement=colocated (the plan's): frozen like the
            # reference, its own model even under LoRA (disaggregated: workers/teacher.py's ranks)
            self.teacher = teacher_engine(cfg, cfg.actor, self.platform, self.device, **engine_args)
        self.actor = PPOActor(self.engine, cfg.actor, cfg.algorithm,
                              cfg.algorithm.off_policy.resolve(on_policy=role.on_policy), self.device)
        self.critic = self._build_critic(horizon, engine_args)
        self.updates = 0
        return self.engine.num_params

    def _build_critic(self, horizon: int, engine_args: dict) -> CriticUpdate | None:
        """A value model on the same ranks and the same training engine as the policy."""
        cfg = self.cfg
        if not cfg.critic.enable:
            return None
        dtype = torch_dtype(cfg.actor.param_dtype)
        path = cfg.critic.path or cfg.model.path
        model = None
        if cfg.actor.strategy == "fsdp2":  # on the meta device, each rank reading its own shards
            model = sharded_load.deferred_value_model(model_dir(path), dtype, cfg.model.trust_remote_code)
        if model is None:
            model = load_value_model(path, dtype, cfg.model.trust_remote_code).to(self.device)
            if self.world_size > 1:  # the value head starts from random: the same random on every rank
                src = group_leader(engine_args["group"] or dist.group.WORLD)
                for p in model.parameters():
                    dist.broadcast(p.data, src=src, group=engine_args["group"])
        critic_cfg = cfg.actor.model_copy(update={"lr": cfg.critic.lr, "grad_clip": cfg.critic.grad_clip})
        engine = build_engine(model, critic_cfg, self.platform, self.device, horizon=horizon,
                              head=response_values, **engine_args)
        return CriticUpdate(engine, critic_cfg, cfg.algorithm, self.device)

    def _load_model(self, path: str | None = None, deferred: bool = False) -> torch.nn.Module:
        """The policy's model (or `path`'s) on this worker's device; `deferred` under
        actor.strategy=fsdp2: on the meta device, read shard by shard by the engine
        (training/sharded_load.py)."""
        cfg = self.cfg
        model = load_causal_lm(path or cfg.model.path, cfg.actor.param_dtype, cfg.model.trust_remote_code,
                               deferred=deferred and cfg.actor.strategy == "fsdp2",
                               train_vision_tower=cfg.model.train_vision_tower)
        return model if sharded_load.is_deferred(model) else model.to(self.device)

    def _join_process_groups(self, dist_init: str | None, mailbox: Any):
        """Join the world the plan names; returns the trainer ranks' group (None: the whole
        world). Sets `self.transport` on a rank that sends weights to other processes."""
        cfg, rank, role = self.cfg, self.rank, self.role
        self.transport = None
        backend = self.platform.group_backend(self.device.type)
        timeout = timedelta(seconds=cfg.ray.timeout_s)
        if role.layout is not None:  # one world: trainer ranks first, then every replica's ranks
            dist.init_process_group(backend, init_method=dist_init, rank=role.rank,
                                    world_size=role.world_size, timeout=timeout)
            groups = build_groups(role.layout, role.rank, backend=backend, timeout_s=cfg.ray.timeout_s)
            if role.sends_weights:  # the weight-sync group's leader (R5)
                self.transport = open_transport(role, cfg.weights, group=groups.group("weight_sync"),
                                                mailbox=mailbox, device=self.device)
            return groups.group("trainer")
        # the policy ranks alone; replicas, if any, join no collective (the object store)
        if role.world_size > 1:
            dist.init_process_group(backend, init_method=dist_init, rank=rank,
                                    world_size=role.world_size, timeout=timeout)
        if role.sends_weights and not role.colocated_engine:  # publish beside the next update
            self.transport = open_transport(role, cfg.weights, mailbox=mailbox)
        return None

    # --- rollout ------------------------------------------------------------------------------
    def generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                 group_offset: int = 0) -> RolloutBatch:
        """Samples for data rows (`PromptSample`), single- or multi-turn (generation.py)."""
        self._release_cached_memory()
        self.rollout_engine.wake_up()
        try:
            return rollout_rows(self.rollout_engine, self.tokenizer, rows, sampling, seeds, group_offset,
                                self.cfg.agent)
        finally:
            self.rollout_engine.sleep()

    def teacher_generate(self, rows: list[Any], sampling: SamplingParams, seeds: list[int] | None = None,
                         group_offset: int = 0) -> RolloutBatch:
        """The distillation teacher's samples for data rows (its validation accuracy), by an
        engine loaded from distill.teacher for this call (workers/teacher.py)."""
        return teacher_rollout(self.cfg, self.device, self.platform, self.cfg.trainer.seed + 1000 * self.rank,
                               rows, sampling, seeds, group_offset)

    def _release_cached_memory(self) -> None:
        """Hand the training step's cached allocator blocks back to the device before the
        colocated engine wakes (`Platform.empty_cache`): freed activations and gradients stay
        reserved by torch's caching allocator, and a GPU engine mapping its weights and KV cache
        back in (vLLM, SGLang, TensorRT-LLM wake_up) would otherwise run out of memory."""
        self.platform.empty_cache()

    # --- log-probs and update -------------------------------------------------------------------
    def logprobs(self, batch: RolloutBatch, which: str = "reference") -> Ragged:
        """Log-probs of each response token under the reference, the distillation teacher or
        the current policy (which="reference" | "teacher" | "current")."""
        with self._on_free_cores():
            return self._logprobs(batch, which)

    def _on_free_cores(self):
        """The block's intra-op threads on a CPU: the cores that are free, at most
        role.num_threads (polyrl/rollout/native/threads.py). Every computing call of the rank
        (log-probs, values, the update, the weight sync's copies and repacking) runs under it:
        an op split over a core a busy neighbour holds waits for that core's slices."""
        return self.threads.applied() if self.threads is not None else nullcontext()

    def _logprobs(self, batch: RolloutBatch, which: str) -> Ragged:
        if which == "teacher":
            if self.teacher is None:
                raise RuntimeError("no teacher model on the policy ranks: distill.teacher is not set, "
                                   "or distill.placement=disaggregated runs it on its own ranks")
            return self.teacher.logprobs(batch)
        if which == "reference" and self.cfg.model.enabled:  # LoRA: the base model, adapters off
            with adapters_disabled(self.engine.model):
                return self.engine.logprobs(batch)
        engine = self.reference if which == "reference" else self.engine
        if engine is None:
            raise RuntimeError("no reference model: KL is off (algorithm.use_kl_* / kl_coef)")
        return engine.logprobs(batch)

    def values(self, batch: RolloutBatch) -> Ragged:
        """The critic's value of each response token's state (before the update)."""
        with self._on_free_cores():
            return self.critic.engine.logprobs(batch)

    def update(self, batch: RolloutBatch, num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
        """The critic's update (if any), then the policy's — except during the critic's warm-up."""
        out: dict[str, float] = {}
        self.updates += 1
        with self._on_free_cores():
            if self.critic is not None:
                out.update(self.critic.update(batch, num_mini_batches))
                if self.updates <= self.cfg.critic.warmup_steps:
                    out["critic/warmup"] = 1.0
                    return out
            out.update(self.actor.update(batch, num_mini_batches, use_rollout_logprobs, self.version))
        out["perf/peak_memory_gb"] = self.platform.peak_memory_bytes() / 2**30
        return out

    # --- weights ------------------------------------------------------------------------------
    def sync_weights(self, bump: bool = True) -> dict[str, float]:
        """Hand the updated policy to the engines: in place (a colocated engine) or, from the
        rank that sends, over the transport to every replica (which call receive_weights)."""
        self.version += int(bump)
        # rollout.lora_mode=adapter: only the adapter travels (vLLM applies it); else full weights
        adapter = self.cfg.model.enabled and self.cfg.rollout.lora_mode == "adapter"
        if self.transport is None:
            if getattr(self.engine, "gathers_weights", False):  # FSDP2: every rank joins each gather
                for _ in (self.engine.adapter_tensors() if adapter else self.engine.weight_stream().pieces()):
                    pass
            return {}
        if self.rollout_engine is not None:  # in place: a sleeping GPU engine wakes its weights for it
            self._release_cached_memory()
        # a stream: each tensor is gathered / merged as the transport needs it
        with torch.no_grad(), self._on_free_cores():
            stream = self.engine.adapter_stream() if adapter else self.engine.weight_stream()
            metrics = self.transport.send(stream, self.version).metrics()
        publish_s = getattr(self.transport, "publish_s", None)  # object store: off the path
        if publish_s is not None:
            metrics["weight_sync/publish_s"] = publish_s
        return metrics

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """The engine's state (rank 0: the policy in Hugging Face format) plus this rank's RNG
        and weight version."""
        d = Path(directory)
        self.engine.save(d)
        if self.critic is not None:
            (d / "critic").mkdir(exist_ok=True)
            self.critic.engine.save(d / "critic")
        if self.rank == 0:
            self.tokenizer.save_pretrained(str(d / "policy"))
            copy_processor_files(model_dir(self.cfg.model.path), d / "policy")  # a VLM's image processor
        torch.save({"torch_rng": torch.get_rng_state(), "version": self.version, "updates": self.updates},
                   d / f"rank{self.rank}.pt")

    def load_checkpoint(self, directory: str) -> int:
        d = Path(directory)
        self.engine.load(d)
        if self.critic is not None:
            if not (d / "critic").is_dir():
                raise ValueError(f"{d} holds no critic (written with critic.enable=false); resume with "
                                 "critic.enable=false or start fresh (trainer.resume=off)")
            self.critic.engine.load(d / "critic")
        mine = d / f"rank{self.rank}.pt"
        if mine.is_file():
            state = torch.load(mine, weights_only=False)
            torch.set_rng_state(state["torch_rng"])
        else:  # a sharded checkpoint written by fewer ranks (fsdp2 resumes on any world size)
            state = torch.load(d / "rank0.pt", weights_only=False)
            torch.manual_seed(self.cfg.trainer.seed + self.rank + 1000 * state["version"])
        self.version, self.updates = state["version"], state.get("updates", 0)
        if self.rollout_engine is not None:
            self.sync_weights(bump=False)
        return self.version

    def peak_memory_bytes(self) -> int:
        return self.platform.peak_memory_bytes()

    def ping(self) -> int:
        return self.rank

    def close_transport(self) -> None:
        """Finish a weight publication still in flight (object store) and stop its thread; the
        trainer calls this while the mailbox is still up."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def shutdown(self) -> None:
        try:
            self.close_transport()
        except Exception as exc:  # shutting down: say it, then free the rest
            logger.warning("rank %d: the last weight publication failed: %s", self.rank, exc)
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
