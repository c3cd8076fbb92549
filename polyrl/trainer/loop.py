"""The RL loop, readable top to bottom as named steps:

    generate -> reward -> reference log-probs -> advantages -> update -> sync weights -> log

The driver process owns data, rewards and advantages; the policy ranks (Ray actors) own the
model, the optimizer and the colocated rollout engine. In trainer.mode=async the first two steps
become "take a finished batch" from a `RolloutStream` that keeps standalone replicas generating
while the policy trains (async_rollout.py, docs/async.md).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from typing import Any

import numpy as np
import torch
import yaml

from polyrl.algorithms import compute_advantages, kl_penalized_rewards
from polyrl.builtin import resolve
from polyrl.config import to_yaml
from polyrl.data import PromptSample, build_loaders
from polyrl.distributed.ray_launch import init_ray
from polyrl.distributed.waits import gather
from polyrl.platform import get_platform
from polyrl.rewards import RewardManager, RewardRequest
from polyrl.rollout.factory import require_backend
from polyrl.rollout.launch_args import resolve_load_format
from polyrl.trainer.async_rollout import RolloutStream
from polyrl.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    capture_rng,
    check_compatible,
    check_writable,
    complete_checkpoints,
    find_resume_point,
    restore_rng,
    step_dir,
)
from polyrl.trainer.config import JobConfig
from polyrl.trainer.interrupts import TrainingInterrupted, stop_on_signals
from polyrl.trainer.launch_plan import plan_job
from polyrl.trainer.metrics import MetricsWriter, PhaseTimer, response_metrics
from polyrl.trainer.plots import plot_run, print_summary
from polyrl.trainer.samples_log import SampleLog, rows_from_samples
from polyrl.trainer.sinks import build_sinks, check_available
from polyrl.trainer.worker_group import cpus_needed, launch
from polyrl.workers.batch import Sample
from polyrl.workers.model_loading import load_tokenizer
from polyrl.workers.policy import NonFiniteUpdate

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and what to change."""


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.out = cfg.output_path
        self.timer = PhaseTimer()
        self.started_ray = False
        self.start_time = time.perf_counter()
        self.sample_log: SampleLog | None = None
        self.stream: RolloutStream | None = None

    # --- set-up -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.rollout.backend == "native" and cfg.rollout.tensor_parallel_size > 1:
            raise TrainingError("rollout.tensor_parallel_size > 1 needs a GPU engine; the native "
                                "engine runs one rank per replica (set rollout.tensor_parallel_size=1)")
        require_backend(cfg.rollout.backend)
        check_available(cfg.logging.sinks)  # a missing tensorboard/wandb fails now, not after loading
        check_writable(self.out, need_bytes=0)
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)

        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
        data_cfg = cfg.data.model_copy(update={
            "train_files": [resolve(f) for f in cfg.data.train_files],
            "val_files": [resolve(f) for f in cfg.data.val_files]})
        self.train_loader, self.val_loader = build_loaders(data_cfg, self.tokenizer)
        self.rewards = RewardManager(cfg.reward)
        self.rewards.check_sources(self.train_loader.dataset.data_sources)
        if self.val_loader is not None:
            self.rewards.check_sources(self.val_loader.dataset.data_sources)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * len(self.train_loader)
        if cfg.rollout.max_model_len is None:
            longest = max(len(p.prompt_ids) for p in self.train_loader.dataset)
            if self.val_loader is not None:
                longest = max(longest, max(len(p.prompt_ids) for p in self.val_loader.dataset))
            cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
                update={"max_model_len": longest + cfg.rollout.response_length})})
            self.cfg = cfg

        self.platform = get_platform(cfg.platform)
        import ray

        self.started_ray = not ray.is_initialized()
        per_actor, needed = cpus_needed(cfg)
        cores = os.cpu_count() or 1
        if cfg.ray.num_cpus is None and cfg.ray.address is None and needed > cores:
            logger.warning("%d actors x %d CPU(s) on %d core(s): they share cores (slower, "
                           "not wrong)", needed // per_actor, per_actor, cores)
        # the ray.init arguments `polyrl train --dry-run` shows
        init_ray(self.platform, **plan_job(cfg, self.platform).ray_init, config_env=cfg.env,
                 backend=cfg.rollout.backend, placement=cfg.rollout.placement, mode=cfg.trainer.mode)
        available = ray.available_resources().get("CPU", 0)
        deadline = time.perf_counter() + 10  # a previous run's killed actors free CPUs lazily
        while available < needed and time.perf_counter() < deadline:
            time.sleep(0.2)
            available = ray.available_resources().get("CPU", 0)
        if available < needed:
            raise TrainingError(
                f"the run's actors reserve {needed} CPUs ({per_actor} per rank) but Ray has {available:g} "
                "free; lower actor.num_cpus_per_worker or rollout.num_replicas, or add CPUs (ray.num_cpus)")
        self.policy, self.rollout = launch(cfg, self.platform, self.total_steps)
        self.engines = self.rollout or self.policy  # whoever hosts the rollout engines
        if cfg.rollout.placement == "standalone" and resolve_load_format(cfg.rollout) == "dummy":
            self.sync_weights(bump=False)  # FP8 replicas start on dummy weights (R4): fill them first
        if cfg.trainer.mode == "async":
            self.stream = RolloutStream(cfg, self.rollout, self.train_loader, self.score)
            # every wait on the policy (update, log-probs, checkpoint) keeps the replicas fed
            self.policy.waiter = self.rollout.waiter = self.stream.gather
        self.use_rollout_logprobs = self._use_rollout_logprobs()
        self.checkpoints = CheckpointWriter(self.out, cfg.trainer.keep_last)
        # model + tokenizer + two Adam moments, fp32, for each kept checkpoint plus the one in flight
        check_writable(self.out, self.policy.num_params * 12 * (cfg.trainer.keep_last + 1))
        logger.info("policy: %s (%.2fM parameters) on %s, %d rank(s); %d steps of %d prompts x %d samples",
                    cfg.model.path, self.policy.num_params / 1e6, self.platform.describe(),
                    self.policy.world_size, self.total_steps, cfg.data.train_batch_size, cfg.rollout.n)

    def _use_rollout_logprobs(self) -> bool:
        mode = self.cfg.actor.old_logprobs
        if mode != "auto":
            return mode == "rollout"
        if self.cfg.trainer.mode == "async":  # stale behaviour policy: PPO's old side is proximal
            return False
        a, r = self.cfg.actor, self.cfg.rollout
        # the engine's log-probs equal the trainer's only when both compute in the same dtype
        return r.backend == "native" and r.dtype == a.param_dtype == a.compute_dtype == "float32"

    # --- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            self.setup()
            with stop_on_signals() as stop:
                return self._run(start, stop)
        finally:
            self.shutdown()
            if self.started_ray:
                import ray

                ray.shutdown()

    def shutdown(self) -> None:
        """Stop generating and shut the run's actors down (Ray itself stays up)."""
        if self.stream is not None:
            self.stream.close()
        policy = getattr(self, "policy", None)  # None before setup() and after a shutdown
        groups = [g for g in (getattr(self, "rollout", None), policy) if g is not None]
        for group in groups:
            group.waiter = gather
        if policy is not None and self.cfg.weight_transport == "object_store":
            try:  # a publication still in flight lands while the mailbox is up
                policy.call("close_transport", phase="shutdown")
            except Exception as exc:
                logger.warning("the last weight publication failed: %s", exc)
        for group in groups:
            group.shutdown()
        self.rollout = self.policy = None

    def _run(self, start: float, stop) -> dict[str, Any]:
        cfg = self.cfg
        state = self.resume_or_start()
        first = state["step"] + 1
        resume_step = state["step"] or None  # None: a fresh run (old metrics/samples are cleared)
        sinks = build_sinks(cfg.logging.sinks, self.out, cfg.logging.resolved_run_name(self.out),
                            cfg.model_dump(mode="json"), wandb_mode=cfg.logging.wandb_mode,
                            wandb_project=cfg.logging.wandb_project, resume_step=resume_step)
        self.sample_log = SampleLog(self.out, resume_step) if cfg.logging.samples_every else None
        writer = MetricsWriter(sinks, self.total_steps, state["step"], cfg.trainer.progress_bar)
        initial, final, final_step = state.get("initial_val"), None, None
        try:
            if first == 1 and self.val_loader is not None and cfg.trainer.val_before_train:
                initial = self.validate()
                writer.log(0, initial)
            for step in range(first, self.total_steps + 1):
                metrics = self.train_step(step)
                if self.val_loader is not None and cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                    final, final_step = self.validate(), step
                    metrics.update(final)
                if step % cfg.trainer.log_every == 0 or step == self.total_steps:
                    writer.log(step, metrics)
                writer.progress(step, metrics)
                last = step == self.total_steps
                if stop.requested or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) \
                        or (last and cfg.trainer.save_at_end):
                    if not stop.requested or cfg.trainer.save_on_interrupt:
                        self.save(step, initial)
                if stop.requested and not last:
                    where = (f"checkpoint {step_dir(self.out, step)}" if cfg.trainer.save_on_interrupt
                             else "no checkpoint (trainer.save_on_interrupt=false)")
                    raise TrainingInterrupted(
                        f"stopped after step {step} of {self.total_steps}; wrote {where}. "
                        f"Continue with the same command (trainer.resume=auto).", stop.exit_code)
            if self.val_loader is not None and final_step != self.total_steps:
                final = self.validate()
                writer.log(self.total_steps, final)
        finally:
            writer.close()
        summary = {
            "initial_accuracy": initial.get("val/acc") if initial else None,
            "final_accuracy": final.get("val/acc") if final else None,
            "steps": self.total_steps,
            "wall_seconds": round(time.perf_counter() - start + state.get("wall_seconds", 0.0), 2),
            "output_dir": str(self.out),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.logging.plot_at_end:
            try:
                logger.info("curves: %s (redraw any time: polyrl plot %s)", plot_run(self.out), self.out)
                if cfg.trainer.progress_bar:
                    from rich.console import Console

                    print_summary(self.out, Console(stderr=True))
            except Exception as exc:  # a plotting problem must not fail a finished run
                logger.warning("could not draw the curves: %s", exc)
        return summary

    # --- checkpoints --------------------------------------------------------------------------
    def resume_or_start(self) -> dict[str, Any]:
        resume_dir = find_resume_point(self.cfg.trainer.resume, self.out)
        if resume_dir is None:
            return {"step": 0}
        saved_cfg = yaml.safe_load((resume_dir / "config.yaml").read_text())
        changed = check_compatible(saved_cfg, self.cfg.model_dump(mode="json"))
        if changed:
            logger.info("resuming with changed settings (allowed): %s", ", ".join(changed))
        state = torch.load(resume_dir / "driver.pt", weights_only=False)
        self.train_loader.load_state_dict(state["data"])
        restore_rng(state["rng"])
        if self.stream is not None:  # before any wait below pumps generation
            if "async" not in state:
                raise TrainingError(f"{resume_dir} was written by a trainer.mode=sync run; resume it "
                                    "with trainer.mode=sync or start fresh (trainer.resume=off)")
            self.stream.load_state_dict(state["async"])
        elif "async" in state:
            logger.warning("resuming an async checkpoint synchronously: %d drawn but untrained "
                           "prompts are skipped", len(state["async"]["pending"]) + len(state["async"]["ready"]))
        self.policy.call("load_checkpoint", str(resume_dir), phase="resume")
        if self.rollout is not None:  # replicas start from the model on disk: send the checkpoint's
            self.sync_weights(bump=False)
        logger.info("resumed from %s (step %d)", resume_dir, state["step"])
        return state

    def save(self, step: int, initial_val: dict | None) -> None:
        tmp = self.checkpoints.begin(step)
        try:
            self.policy.call("save_checkpoint", str(tmp), phase="checkpoint")
            driver = {"step": step, "data": self.train_loader.state_dict(), "rng": capture_rng(),
                      "initial_val": initial_val,
                      "wall_seconds": time.perf_counter() - self.start_time}
            if self.stream is not None:  # drawn but untrained prompts, finished groups included
                driver["async"] = self.stream.state_dict()
            path = self.checkpoints.commit(tmp, step, driver, self.cfg.model_dump(mode="json"))
        except OSError as exc:
            self.checkpoints.abort(tmp)
            kept = complete_checkpoints(self.out)
            raise CheckpointError(
                f"could not write the checkpoint of step {step} ({exc}); "
                f"{'the previous checkpoint ' + str(kept[-1]) + ' is intact' if kept else 'no earlier checkpoint exists'}"
            ) from None
        logger.debug("checkpoint written: %s", path)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, timer = self.cfg, self.timer
        t0 = time.perf_counter()
        if self.stream is not None:
            with timer("generate"):  # async: waiting for finished groups (the trainer's idle time)
                groups, metrics = self.stream.take_batch()
            samples = [s for g in groups for s in g.samples]
            metrics.update(response_metrics(samples))
        else:
            batch = self.train_loader.next_batch()
            with timer("generate"):
                samples = self.generate(batch, step)
            with timer("reward"):
                metrics = self.score(samples, batch)
        if self.sample_log is not None and step % cfg.logging.samples_every == 0:
            # before advantages(), which drops each sample's prompt
            self.sample_log.write(step, rows_from_samples(samples, cfg.logging.num_samples))
        if cfg.algorithm.uses_reference:
            with timer("reference"):
                for s, lp in zip(samples, self.policy.logprobs(samples, "reference")):
                    s.ref_logprobs = lp
        metrics.update(self.advantages(samples))
        if cfg.algorithm.filter_tied_groups:
            samples = [s for s in samples if not s.extra.get("tied")]
        with timer("update"):
            try:
                metrics.update(self.policy.update(samples, cfg.num_mini_batches, self.use_rollout_logprobs))
            except Exception as exc:
                if isinstance(getattr(exc, "cause", exc), NonFiniteUpdate):
                    kept = complete_checkpoints(self.out)
                    last = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was written yet"
                    raise TrainingError(f"step {step}: {getattr(exc, 'cause', exc)}; {last}") from None
                raise
        with timer("sync_weights"):
            metrics.update(self.sync_weights())
        metrics.update(timer.pop())
        metrics["timing/step"] = time.perf_counter() - t0
        metrics["perf/samples_per_s"] = len(samples) / metrics["timing/step"]
        # async: generation overlaps the step, so its rate is tokens per step-second
        gen_s = metrics["timing/step"] if self.stream is not None else metrics["timing/generate"]
        metrics["perf/generate_tokens_per_s"] = metrics["perf/generated_tokens"] / max(gen_s, 1e-9)
        metrics["train/epoch"] = self.train_loader.epoch
        return metrics

    # --- the named steps ----------------------------------------------------------------------
    def generate(self, batch: list[PromptSample], step: int, validation: bool = False) -> list[Sample]:
        r = self.cfg.rollout
        sampling = dict(
            temperature=r.val_temperature if validation else r.temperature,
            top_p=1.0 if validation else r.top_p,
            top_k=-1 if validation else r.top_k,
            n=r.val_n if validation else r.n,
            max_tokens=r.response_length,
        )
        # one seed per (run, step, prompt): the same run draws the same samples, however batched
        seeds = [hash((self.cfg.trainer.seed, step, p.index, validation)) % (2**31) for p in batch]
        prompts, phase = [p.prompt_ids for p in batch], "validation" if validation else "generate"
        if self.stream is not None:  # async (validation only): a replica that dies is replaced
            samples = self.stream.generate_sharded(prompts, sampling, seeds, phase)
        else:
            samples = self.engines.generate(prompts, sampling, seeds, phase=phase)
        for s in samples:
            s.extra["prompt"] = batch[s.group]
        return samples

    def sync_weights(self, bump: bool = True) -> dict[str, float]:
        """Hybrid: each rank copies its weights into its engine. Standalone: the weight-sync
        leader sends, every replica receives, all under one deadline that names the missing."""
        if self.stream is not None:  # publish to the mailbox; replicas fetch it while generating
            results = self.policy.call("sync_weights", bump, phase="weight sync")
            self.stream.published(results[0]["weight_sync/version"] if results[0] else self.stream.version)
            return results[0]
        policy_refs = [w.sync_weights.remote(bump) for w in self.policy.workers]
        refs, names = list(policy_refs), list(self.policy.names)
        if self.rollout is not None:
            refs += [w.receive_weights.remote() for w in self.rollout.workers]
            names += self.rollout.names
        results = gather(refs, names, phase="weight sync", timeout_s=self.cfg.ray.timeout_s)
        return results[0]

    def score(self, samples: list[Sample], batch: list[PromptSample]) -> dict[str, float]:
        requests = [RewardRequest(p.data_source, s.text, p.ground_truth, s.finished_with_eos, p.extra_info)
                    for s in samples for p in [s.extra["prompt"]]]
        result = self.rewards.score(requests)
        for s, score, acc in zip(samples, result.scores, result.accs):
            s.reward, s.acc = score, acc
        return {**result.metrics, **response_metrics(samples)}

    def advantages(self, samples: list[Sample]) -> dict[str, float]:
        algo = self.cfg.algorithm
        R = max(max(len(s.response_ids) for s in samples), 1)
        mask = torch.zeros(len(samples), R)
        for i, s in enumerate(samples):
            mask[i, : len(s.response_ids)] = 1
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples])
        metrics: dict[str, float] = {}
        if algo.use_kl_in_reward and algo.kl_coef > 0:
            logp, ref = (torch.zeros(len(samples), R) for _ in range(2))
            for i, s in enumerate(samples):
                logp[i, : len(s.response_ids)] = torch.tensor(s.rollout_logprobs)
                ref[i, : len(s.response_ids)] = torch.tensor(s.ref_logprobs)
            rewards, kl_metrics = kl_penalized_rewards(rewards, logp, ref, mask, kl_coef=algo.kl_coef,
                                                       estimator=algo.kl_estimator)
            metrics.update(kl_metrics)
        out = compute_advantages(algo, rewards, groups, mask)
        for i, s in enumerate(samples):
            s.advantages = out.advantages[i, : len(s.response_ids)].tolist()
            s.extra["tied"] = bool(out.tied_mask[i])
            s.extra.pop("prompt", None)  # workers do not need it
        metrics.update(out.metrics)
        return metrics

    def validate(self) -> dict[str, float]:
        """Held-out accuracy (mean over val_n samples per prompt; pass@k when val_n > 1)."""
        if self.stream is not None:  # measure the current policy, not a replica still behind it
            self.stream.wait_replicas_current()
        accs, scores, lengths, passes = [], [], [], []
        for batch in self.val_loader.epoch_batches():
            samples = self.generate(batch, step=0, validation=True)
            self.score(samples, batch)
            accs += [s.acc for s in samples]
            scores += [s.reward for s in samples]
            lengths += [len(s.response_ids) for s in samples]
            by_group: dict[int, list[float]] = {}
            for s in samples:
                by_group.setdefault(s.group, []).append(s.acc)
            passes += [float(max(v) > 0) for v in by_group.values()]
        out = {"val/acc": float(np.mean(accs)), "val/reward": float(np.mean(scores)),
               "val/response_length": float(np.mean(lengths))}
        if self.cfg.rollout.val_n > 1:
            out[f"val/pass@{self.cfg.rollout.val_n}"] = float(np.mean(passes))
        return out

