"""The policy worker: one rank of policy training, with its colocated rollout engine.

Runs inside a Ray actor (the trainer wraps it with `ray.remote`). In hybrid placement the
engine lives in the same process and shares the rank's device: after each update the weights
are copied into the engine in place (version-stamped) and its KV cache is freed while training.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polyrl.algorithms import actor_loss
from polyrl.platform import get_platform
from polyrl.rollout.factory import build_colocated_engine
from polyrl.distributed.layout import build_groups, group_leader
from polyrl.weights import build_transport
from polyrl.workers.batch import Sample, collate, plan_micro_batches, split_evenly
from polyrl.workers.generation import generate_samples
from polyrl.workers.logprobs import response_logprobs
from polyrl.workers.rollout_worker import rollout_layout, transport_context
from polyrl.workers.model_loading import load_causal_lm, load_tokenizer
from polyrl.workers.optim import build_optimizer

logger = logging.getLogger(__name__)


SHARE_METRICS = frozenset({"actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy"})
"""Metrics that are a micro-batch's share of a global mean: summed over micro-batches and ranks."""
LOCAL_METRICS = frozenset({"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                           "actor/ratio_mean"})
"""Per-token means of one micro-batch: weighted by tokens, averaged over ranks."""
OFF_POLICY_METRICS = frozenset({"off_policy/is_weight_mean", "off_policy/is_clipped_frac",
                                "off_policy/masked_frac", "off_policy/kl_rollout_proximal"})
"""Per-token means like LOCAL_METRICS, present when the off-policy correction is on."""
MAX_METRICS = frozenset({"off_policy/is_weight_max"})
"""Maxima: the largest over micro-batches and ranks."""


class NonFiniteUpdate(RuntimeError):
    pass


class PolicyWorker:
    def __init__(self, cfg: Any, rank: int, world_size: int, total_steps: int, num_threads: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.total_steps = total_steps
        self.standalone = cfg.rollout.placement == "standalone"
        torch.set_num_threads(num_threads)
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.torch_device(0)
        self.version = 0
        self.nonfinite_in_a_row = 0
        self.off_policy = cfg.algorithm.off_policy.resolve(cfg.trainer.mode)

    def address(self) -> str:
        """A rendezvous address on this worker's node (asked of rank 0 only)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, dist_init: str | None, mailbox: Any = None) -> int:
        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        torch.manual_seed(cfg.trainer.seed + rank)
        self.train_group, self.transport = None, None  # None: the default (world) group
        backend = (self.platform.cpu_dist_backend() if self.device.type == "cpu"
                   else self.platform.dist_backend())
        if self.standalone and cfg.trainer.mode == "sync":
            # one world: trainer ranks first, then every rollout replica's ranks
            layout = rollout_layout(cfg)
            dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=layout.world_size,
                                    timeout=timedelta(seconds=cfg.ray.timeout_s))
            groups = build_groups(layout, rank, backend=backend, timeout_s=cfg.ray.timeout_s)
            self.train_group = groups.group("trainer")
            if rank == groups.leader("weight_sync"):
                self.transport = build_transport(cfg.resolved_weights, "standalone",
                                                 **transport_context(cfg, groups.group("weight_sync"), mailbox))
        else:
            # hybrid, or async: replicas join no collective (weights go through the object store)
            if world_size > 1:
                dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=cfg.ray.timeout_s))
            if self.standalone and rank == 0:  # async: publish beside the next update (object_store.py)
                self.transport = build_transport(cfg.resolved_weights, "standalone", mailbox=mailbox)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                        cfg.model.trust_remote_code)
        self.model = load_causal_lm(cfg.model.path, cfg.actor.param_dtype,
                                    cfg.model.trust_remote_code).to(self.device)
        if cfg.actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        if world_size > 1:  # identical start on every rank, whatever each rank's RNG did
            src = group_leader(self.train_group or dist.group.WORLD)
            for p in self.model.parameters():
                dist.broadcast(p.data, src=src, group=self.train_group)
        self.reference = None
        if cfg.algorithm.uses_reference:
            self.reference = load_causal_lm(cfg.model.path, cfg.actor.param_dtype,
                                            cfg.model.trust_remote_code).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), cfg.actor,
                                                         self.total_steps)
        self.engine = None
        if not self.standalone:
            self.engine = build_colocated_engine(cfg.rollout, self.model, self.tokenizer, self.device,
                                                 seed=cfg.trainer.seed + 1000 * rank,
                                                 platform=self.platform)
            self.engine.sleep()
        return sum(p.numel() for p in self.model.parameters())

    # --- rollout ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: dict, seeds: list[int] | None = None,
                 group_offset: int = 0) -> list[Sample]:
        self.engine.wake_up()
        try:
            return generate_samples(self.engine, self.tokenizer, prompts, sampling, seeds, group_offset)
        finally:
            self.engine.sleep()

    # --- log-probs ----------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, samples: list[Sample], which: str = "reference") -> list[list[float]]:
        """Log-probs of each sample's response under the reference (or current) policy."""
        model = self.reference if which == "reference" else self.model
        if model is None:
            raise RuntimeError("no reference model: KL is off (algorithm.use_kl_* / kl_coef)")
        was_training = model.training
        model.eval()
        out: list[list[float]] = [[] for _ in samples]
        for idx in plan_micro_batches(samples, self.cfg.actor.micro_batch_tokens):
            mb = collate(samples, idx, self.device)
            lp, _ = response_logprobs(model, mb)
            for row, i in enumerate(idx):
                out[i] = lp[row, : len(samples[i].response_ids)].tolist()
        model.train(was_training)
        return out

    # --- update -------------------------------------------------------------------------------
    def update(self, samples: list[Sample], num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
        """PPO epochs over `samples` split into `num_mini_batches` optimizer steps."""
        cfg, algo = self.cfg.actor, self.cfg.algorithm
        single_step = num_mini_batches == 1 and cfg.ppo_epochs == 1
        if not single_step and not use_rollout_logprobs:
            for s, lp in zip(samples, self.logprobs(samples, which="current")):
                s.old_logprobs = lp  # proximal; the rollout's stay for the off-policy correction
        metrics: dict[str, list[float]] = {}
        start = time.perf_counter()
        tokens = 0
        for _ in range(cfg.ppo_epochs):
            for chunk in split_evenly(list(range(len(samples))), num_mini_batches):
                mini = [samples[i] for i in chunk]
                tokens += sum(s.length for s in mini)
                step_metrics = self._optimizer_step(mini, single_step and not use_rollout_logprobs)
                for k, v in step_metrics.items():
                    metrics.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        elapsed = time.perf_counter() - start
        out["perf/update_tokens_per_s"] = tokens / max(elapsed, 1e-9)
        out["perf/peak_memory_gb"] = self.platform.peak_memory_bytes() / 2**30
        return out

    def _global(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.train_group)
        return t.tolist()

    def _optimizer_step(self, samples: list[Sample], detach_as_old: bool) -> dict[str, float]:
        cfg, algo = self.cfg.actor, self.cfg.algorithm
        num_tokens, num_seqs = self._global(sum(len(s.response_ids) for s in samples), len(samples))
        agg = {"num_tokens": max(num_tokens, 1.0), "num_seqs": max(num_seqs, 1.0)}
        self.optimizer.zero_grad(set_to_none=True)
        # the same keys on every rank, even one without samples, so the all-reduce lines up
        local = LOCAL_METRICS | (OFF_POLICY_METRICS if self.off_policy.active else frozenset())
        sums: dict[str, float] = dict.fromkeys(SHARE_METRICS | local, 0.0)
        maxima: dict[str, float] = dict.fromkeys(MAX_METRICS, 0.0) if self.off_policy.active else {}
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                  enabled=cfg.compute_dtype == "bfloat16")
        compute = torch.bfloat16 if cfg.compute_dtype == "bfloat16" else torch.float32
        for idx in plan_micro_batches(samples, cfg.micro_batch_tokens):
            attention = self.platform.training_attention(compute)
            mb = collate(samples, idx, self.device)
            with autocast, attention:
                logprob, entropy = response_logprobs(self.model, mb, with_entropy=True,
                                                     entropy_grad=algo.entropy_coeff > 0)
            old = logprob.detach() if detach_as_old else mb.old_logprobs
            loss, m = actor_loss(algo, logprob, old, mb.advantages, mb.response_mask,
                                 ref_logprob=mb.ref_logprobs, entropy=entropy,
                                 rollout_logprob=mb.rollout_logprobs, off_policy=self.off_policy, **agg)
            loss.backward()
            weight = mb.num_tokens / agg["num_tokens"]
            for k in MAX_METRICS & m.keys():
                maxima[k] = max(maxima.get(k, 0.0), m.pop(k))
            for k, v in m.items():
                if k not in sums and self.world_size > 1:
                    continue  # a key only some ranks may have cannot be all-reduced
                # losses are already this micro-batch's share of the global mean; per-token
                # statistics (clip fraction, ratio) are local means: weight them by tokens
                sums[k] = sums.get(k, 0.0) + (v if k in SHARE_METRICS else v * weight)
        if self.world_size > 1:  # shares add up across ranks; local means are averaged
            keys = sorted(sums)
            totals = self._global(*(sums[k] for k in keys))
            sums = {k: t if k in SHARE_METRICS else t / self.world_size for k, t in zip(keys, totals)}
            if maxima:
                peaks = torch.tensor([maxima[k] for k in sorted(maxima)], dtype=torch.float64)
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.train_group)
                maxima = dict(zip(sorted(maxima), peaks.tolist()))
        sums.update(maxima)
        grad_norm = self._reduce_and_clip()
        sums["actor/grad_norm"] = grad_norm
        sums["actor/lr"] = self.scheduler.get_last_lr()[0]
        if not math.isfinite(grad_norm) or not math.isfinite(sums["actor/loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            sums["actor/nonfinite_skipped"] = 1.0
            if self.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                raise NonFiniteUpdate(
                    f"{self.nonfinite_in_a_row} updates in a row had a NaN/inf loss or gradient "
                    f"(each was skipped); stopping. Lower actor.lr, enable actor.grad_clip, or "
                    f"check the rewards. Last loss={sums['actor/loss']}, grad_norm={grad_norm}"
                )
        else:
            self.nonfinite_in_a_row = 0
            sums["actor/nonfinite_skipped"] = 0.0
            self.optimizer.step()
            self.scheduler.step()  # a skipped update is not a step of the schedule
        return sums

    def _reduce_and_clip(self) -> float:
        params = list(self.model.parameters())
        for p in params:  # a rank with no samples this step still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:  # sum of shares = the global loss's gradient
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.train_group)
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
        max_norm = self.cfg.actor.grad_clip or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    # --- weights ------------------------------------------------------------------------------
    def sync_weights(self, bump: bool = True) -> dict[str, float]:
        """Hand the updated policy to the engines: in place (hybrid) or, from the weight-sync
        leader, over the transport to every standalone replica (which call receive_weights)."""
        self.version += int(bump)
        with torch.no_grad():
            named = dict(self.model.named_parameters())
            if self.engine is not None:
                self.engine.update_weights(named, self.version)
            elif self.transport is not None:
                metrics = self.transport.send(named, self.version).metrics()
                publish_s = getattr(self.transport, "publish_s", None)  # object store: off the path
                if publish_s is not None:
                    metrics["weight_sync/publish_s"] = publish_s
                return metrics
        return {}

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """Rank 0 writes the policy in Hugging Face format; every rank its optimizer and RNG."""
        d = Path(directory)
        if self.rank == 0:
            self.model.save_pretrained(str(d / "policy"), safe_serialization=True)
            self.tokenizer.save_pretrained(str(d / "policy"))
        torch.save({
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "version": self.version,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }, d / f"rank{self.rank}.pt")

    def load_checkpoint(self, directory: str) -> int:
        d = Path(directory)
        saved = load_causal_lm(str(d / "policy"), self.cfg.actor.param_dtype, self.cfg.model.trust_remote_code)
        self.model.load_state_dict(saved.state_dict())
        del saved
        state = torch.load(d / f"rank{self.rank}.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.version = state["version"]
        if self.engine is not None:
            with torch.no_grad():
                self.engine.update_weights(dict(self.model.named_parameters()), self.version)
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
