"""The RL loop, readable top to bottom as named steps:

    next batch (generate + reward) -> reference log-probs -> advantages -> update -> publish -> log

The driver process owns data, rewards and advantages; the policy ranks (Ray actors) own the
model and the optimizer. Where rollout runs and when (colocated, disaggregated, streaming) is a
`Topology` (polyrl/topology/): the loop asks it for the next scored batch and to publish each new
policy version, and never asks which one it is.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from polyrl.algorithms import compute_advantages, kl_penalized_rewards, overlong_penalty
from polyrl.algorithms.distill import check_teacher_tokenizer, distill_advantages
from polyrl.backends import capabilities
from polyrl.batch import Ragged, RolloutBatch
from polyrl.config import ConfigError, to_yaml
from polyrl.distributed.waits import RemoteActorDied
from polyrl.modeling import seed_everything
from polyrl.platform import get_platform
from polyrl.rewards import RewardManager, RewardRequest
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.factory import installed_version, require_backend
from polyrl.topology import Topology, TopologyContext, TrainingError, build_topology
from polyrl.topology.base import prompt_seeds, teacher_generate
from polyrl.topology.resources import cpus_needed
from polyrl.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    capture_rng,
    read_resume_point,
    check_writable,
    complete_checkpoints,
    restore_rng,
    step_dir,
)
from polyrl.job import JobConfig
from polyrl.trainer.interrupts import TrainingInterrupted, stop_on_signals
from polyrl.topology.run_plan import RunData, RunPlan, resolve
from polyrl.trainer.metrics import MetricsWriter, PhaseTimer, response_metrics
from polyrl.trainer.plots import plot_run, print_summary
from polyrl.trainer.preflight import check_job
from polyrl.trainer.run_data import load_run_data
from polyrl.trainer.sample_images import RowImages, SampleImages
from polyrl.trainer.samples_log import SampleLog, rows_from_batch
from polyrl.trainer.sinks import build_sinks, check_available
from polyrl.training.base import NonFiniteUpdate

logger = logging.getLogger(__name__)

__all__ = ["Trainer", "TrainingError"]


def use_rollout_logprobs(cfg: JobConfig) -> bool:
    """Whether PPO's old log-probs are the rollout's (no recompute pass): as actor.old_logprobs
    says, or with "auto" when the topology is on-policy (a streaming run's samples may be stale:
    PPO's old side is then the proximal policy, recomputed) and the engine declares log-probs in
    the trainer's numerics for the run's dtypes (`EngineCapabilities.trainer_logprob_dtypes`,
    polyrl/backends.py)."""
    mode = cfg.actor.old_logprobs
    if mode != "auto":
        return mode == "rollout"
    if not cfg.topology.on_policy:
        return False
    a, r = cfg.actor, cfg.rollout
    return capabilities(r.backend).logprobs_match_trainer(r.dtype, a.param_dtype, a.compute_dtype)


def wait_for_cpus(needed: int, per_actor: int, within_s: float = 10.0) -> None:
    """Ray's free CPUs reach `needed` (a previous run's killed actors free theirs lazily), or one
    line naming the keys that lower the need."""
    import ray

    available = ray.available_resources().get("CPU", 0)
    deadline = time.perf_counter() + within_s
    while available < needed and time.perf_counter() < deadline:
        time.sleep(0.2)  # polling Ray's accounting: it offers no event to wait on
        available = ray.available_resources().get("CPU", 0)
    if available < needed:
        raise TrainingError(
            f"the run's actors reserve {needed} CPUs ({per_actor} per rank) but Ray has {available:g} "
            "free; lower actor.world_size, actor.num_cpus_per_worker or rollout.num_replicas, or "
            "add CPUs (ray.num_cpus)")


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.out = cfg.output_path
        self.timer = PhaseTimer()
        self.started_ray = False
        self.start_time = time.perf_counter()
        self.sample_log: SampleLog | None = None
        self.sample_images: SampleImages | None = None
        """Grids of validation images with the answers (RUN_DIR/samples); they skip text-only batches."""
        self.topology: Topology | None = None
        self.teacher_val: dict[str, float] | None = None
        """The distillation teacher's held-out metrics (distill/teacher_val_*), once at the start."""

    # --- set-up: check, load the data, plan, write, start ---------------------------------------
    def setup(self) -> None:
        """Everything before the first step, in order: the checks that need no data, the data
        (and the checks that need it), the plan (`resolve`: pure, before Ray), the run's files,
        then `start(plan)`."""
        self.check_config()
        self.load_data()
        self.plan = resolve(self.cfg, RunData.of(self.train_loader, self.val_loader),
                            get_platform(self.cfg.platform), installed_version(self.cfg.rollout.backend))
        self.cfg, self.platform, self.total_steps = self.plan.cfg, self.plan.platform, self.plan.total_steps
        self.write_run_files()
        self.start(self.plan)

    def check_config(self) -> None:
        """What the config alone decides, before anything is loaded: one line each."""
        cfg = self.cfg
        require_backend(cfg.rollout.backend)  # a plugin that cannot be imported: one line, now
        if cfg.rollout.tensor_parallel_size > 1 and not capabilities(cfg.rollout.backend).tensor_parallel:
            raise TrainingError(f"rollout.tensor_parallel_size > 1 needs a GPU engine (one that declares "
                                f"tensor_parallel); the {cfg.rollout.backend} engine runs one rank per "
                                "replica (set rollout.tensor_parallel_size=1)")
        check_available(cfg.logging.sinks)  # a missing tensorboard/wandb fails now, not after loading
        check_writable(self.out, need_bytes=0)

    def load_data(self) -> None:
        """The tokenizer, the data and the reward functions, with the checks they allow (one
        clear line now, not a traceback after Ray started)."""
        cfg = self.cfg
        seed_everything(cfg.trainer.seed)
        self.tokenizer, self.train_loader, self.val_loader = load_run_data(cfg)
        check_job(cfg, self.train_loader.dataset, self.val_loader.dataset if self.val_loader else None,
                  self._model_config())
        if cfg.distill.enabled:  # the teacher scores the student's token ids: same vocabulary
            try:
                check_teacher_tokenizer(cfg.distill.teacher, cfg.model.tokenizer_path or cfg.model.path,
                                        cfg.model.trust_remote_code)
            except ValueError as exc:
                raise ConfigError([str(exc)]) from None
        self.rewards = RewardManager(cfg.reward, platform_name=cfg.platform)
        self.rewards.check_sources(self.train_loader.dataset.data_sources)
        if self.val_loader is not None:
            self.rewards.check_sources(self.val_loader.dataset.data_sources)

    def write_run_files(self) -> None:
        """config.yaml (the planned config, filled in), and the resume point read and checked: a
        checkpoint this run cannot resume (another model, strategy or LoRA setting) fails now,
        as one line, not inside an actor after Ray and the model started."""
        (self.out / "config.yaml").write_text(to_yaml(self.cfg))
        self.resume_point = read_resume_point(self.cfg.trainer.resume, self.out, self.cfg.model_dump(mode="json"))

    def start(self, plan: RunPlan) -> None:
        """Launch exactly `plan`: Ray (or this process, ray.enabled=false), then the topology's
        actors with their planned options and role plans, then a disaggregated teacher's."""
        cfg = plan.cfg
        if cfg.ray.enabled:
            self._start_ray(plan)
        else:  # the policy worker and its engine are objects of this process (topology/in_process.py)
            logger.info("ray.enabled=false: one rank, its engine and the trainer in this process")
        self.topology = build_topology(TopologyContext(plan, self.train_loader, self.score, self.timer))
        logger.info("starting the actors (%s)", self.topology.name)  # the interrupt tests signal on this line
        self.topology.start()
        self.policy = self.topology.policy
        self.teacher = self.policy  # the ranks that hold the distillation teacher
        if plan.roles("teacher"):  # distill.placement=disaggregated: its own ranks
            self.teacher = self.topology.start_teacher()
            logger.info("distillation teacher: %s (%.2fM parameters) on %d rank(s) of its own (%s)",
                        cfg.distill.teacher, self.teacher.num_params / 1e6, self.teacher.world_size,
                        cfg.distill.strategy or cfg.actor.strategy)
        self.use_rollout_logprobs = use_rollout_logprobs(cfg)
        self.checkpoints = CheckpointWriter(self.out, cfg.trainer.keep_last)
        # model + tokenizer + two Adam moments, fp32, for each kept checkpoint plus the one in flight
        check_writable(self.out, self.policy.num_params * 12 * (cfg.trainer.keep_last + 1),
                       keep_last=cfg.trainer.keep_last)
        logger.info("policy: %s (%.2fM parameters) on %s, %d rank(s); %d steps of %d prompts x %d samples",
                    cfg.model.path, self.policy.num_params / 1e6, self.platform.describe(),
                    self.policy.world_size, self.total_steps, cfg.data.train_batch_size, cfg.rollout.n)

    def _start_ray(self, plan: RunPlan) -> None:
        """Join or start Ray with the plan's arguments (what `polyrl train --dry-run` shows), then
        wait until the run's actors' CPUs are free."""
        import ray

        from polyrl.distributed.ray_launch import init_ray

        cfg = plan.cfg
        self.started_ray = not ray.is_initialized()
        per_actor, needed = cpus_needed(cfg)
        cores = os.cpu_count() or 1
        if cfg.ray.num_cpus is None and cfg.ray.address is None and needed > cores:
            logger.warning("%d actors x %d CPU(s) on %d core(s): they share cores (slower, "
                           "not wrong)", needed // per_actor, per_actor, cores)
        init_ray(plan.launch.job.env, **plan.launch.job.ray_init,  # the planned job env, as printed
                 start_timeout_s=cfg.ray.timeout_s)
        wait_for_cpus(needed, per_actor)

    def _model_config(self) -> Any:
        from transformers import AutoConfig

        from polyrl.training.model_loading import model_dir

        try:
            return AutoConfig.from_pretrained(str(model_dir(self.cfg.model.path)),
                                              trust_remote_code=self.cfg.model.trust_remote_code)
        except (OSError, ValueError):  # loading the model reports it with the fix
            return None

    # --- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            self.setup()
            with stop_on_signals() as stop:
                return self._run(start, stop)
        except RemoteActorDied as exc:
            kept = complete_checkpoints(self.out)
            where = (f"rerunning the same command resumes from checkpoint {kept[-1]}" if kept
                     else "no checkpoint was written yet (trainer.save_every sets how often)")
            raise TrainingError(f"{exc}; {where}") from None
        finally:
            failing = sys.exc_info()[1]
            try:
                self.shutdown()
            except Exception as exc:  # actors stuck in the failed call: report that call's error, not this
                if failing is None:
                    raise
                logger.warning("shutting the run's actors down after the error below failed too: %s", exc)
            finally:
                if self.started_ray:
                    import ray

                    ray.shutdown()

    def shutdown(self) -> None:
        """Stop generating and shut the run's actors down (Ray itself stays up)."""
        topology, self.topology, self.policy = self.topology, None, None
        self.teacher = None  # the topology shuts a disaggregated teacher's ranks down with its own
        try:
            if topology is not None:
                topology.shutdown()
        finally:
            rewards = getattr(self, "rewards", None)
            if rewards is not None:
                rewards.close()  # the reward-model worker and the HTTP loop thread

    def _run(self, start: float, stop) -> dict[str, Any]:
        cfg = self.cfg
        state = self.resume_or_start()
        first = state["step"] + 1
        resume_step = state["step"] or None  # None: a fresh run (old metrics/samples are cleared)
        sinks = build_sinks(cfg.logging.sinks, self.out, cfg.logging.resolved_run_name(self.out),
                            cfg.model_dump(mode="json"), wandb_mode=cfg.logging.wandb_mode,
                            wandb_project=cfg.logging.wandb_project, resume_step=resume_step)
        self.sample_log = SampleLog(self.out, resume_step) if cfg.logging.samples_every else None
        if cfg.logging.samples_every and self.val_loader is not None:
            self.sample_images = SampleImages(self.out, resume_step,
                                              RowImages(cfg.data.val_files, cfg.data.prompt_key))
        writer = MetricsWriter(sinks, self.total_steps, state["step"], cfg.trainer.progress_bar)
        initial, final, final_step = state.get("initial_val"), None, None
        self.teacher_val = state.get("teacher_val")
        try:
            if first == 1 and self.val_loader is not None and cfg.trainer.val_before_train:
                initial = self.validate(step=0)
            if first == 1 and self.val_loader is not None and cfg.distill.enabled \
                    and cfg.distill.validate_teacher:  # once: a resumed run keeps the first
                self.teacher_val = self.validate_teacher()
            if first == 1 and (initial or self.teacher_val):
                writer.log(0, {**(initial or {}), **(self.teacher_val or {})})
            for step in range(first, self.total_steps + 1):
                metrics = self.train_step(step)
                if self.val_loader is not None and cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                    final, final_step = self.validate(step=step), step
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
                final = self.validate(step=self.total_steps)
                writer.log(self.total_steps, final)
        finally:
            writer.close()
        summary = {
            "initial_accuracy": initial.get("val/acc") if initial else None,
            "final_accuracy": final.get("val/acc") if final else None,
            "teacher_accuracy": self.teacher_val.get("distill/teacher_val_acc") if self.teacher_val else None,
            "steps": self.total_steps,
            "wall_seconds": round(time.perf_counter() - start + state.get("wall_seconds", 0.0), 2),
            "output_dir": str(self.out),
            "reward_errors": self.rewards.error_summary(),
            "skipped_data_rows": getattr(self.train_loader.dataset, "num_bad_rows", 0),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        errors = summary["reward_errors"]
        if errors["over_warn_rate"]:
            logger.warning("%d of %d reward calls failed (%.0f%%; first: %s): the run learned from "
                           "failed scores; see reward_errors in %s", errors["errors"] + errors["timeouts"],
                           errors["calls"], 100 * errors["error_rate"], errors["first_error"],
                           self.out / "summary.json")
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
        found = self.resume_point  # read (and checked) in setup, before the actors started
        if found is None:
            return {"step": 0}
        resume_dir, state, changed = found
        if changed:
            logger.info("resuming with changed settings (allowed): %s", ", ".join(changed))
        self.train_loader.load_state_dict(state["data"])
        restore_rng(state["rng"])
        self.topology.load_state_dict(state, str(resume_dir))  # before any wait pumps generation
        self.policy.call("load_checkpoint", str(resume_dir), phase="resume")
        self.topology.after_checkpoint_load()
        logger.info("resumed from %s (step %d)", resume_dir, state["step"])
        return state

    def save(self, step: int, initial_val: dict | None) -> None:
        tmp = self.checkpoints.begin(step)
        try:
            self.policy.call("save_checkpoint", str(tmp), phase="checkpoint")
            driver = {"step": step, "data": self.train_loader.state_dict(), "rng": capture_rng(),
                      "initial_val": initial_val, "teacher_val": self.teacher_val,
                      "wall_seconds": time.perf_counter() - self.start_time}
            driver.update(self.topology.state_dict())  # streaming: drawn but untrained prompts
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
        batch, metrics = self.topology.next_batch(step)
        metrics.update(response_metrics(batch))
        if self.sample_log is not None and step % cfg.logging.samples_every == 0:
            self.sample_log.write(step, rows_from_batch(batch, cfg.logging.num_samples))
        if cfg.algorithm.uses_reference:
            with timer("reference"):
                batch.ref_logprobs = self.policy.logprobs(batch, "reference")
        if cfg.algorithm.uses_critic:
            with timer("values"):
                batch.values = self.policy.values(batch)
        teacher = None
        if cfg.distill.enabled:
            with timer("teacher"):
                teacher = self.teacher.logprobs(batch, "teacher")
        adv_metrics, tied = self.advantages(batch, teacher)
        metrics.update(adv_metrics)
        if cfg.algorithm.drops_tied_groups:  # groups with all-equal rewards teach nothing
            batch = batch.select((~tied).nonzero().flatten())
        if cfg.algorithm.overlong.filter:  # DAPO: a truncated response says nothing about its end
            batch.loss_mask = batch.loss_mask.with_values(
                batch.loss_mask.values * torch.repeat_interleave((~batch.truncated).float(), batch.response_lengths))
        with timer("update"):
            metrics.update(self.update(batch, step))
        with timer("sync_weights"):
            metrics.update(self.topology.publish())
        metrics.update(timer.pop())
        metrics["timing/step"] = time.perf_counter() - t0
        metrics["perf/samples_per_s"] = len(batch) / metrics["timing/step"]
        metrics["train/epoch"] = self.train_loader.epoch
        return metrics

    # --- the named steps ----------------------------------------------------------------------
    def score(self, batch: RolloutBatch) -> dict[str, float]:
        """Rewards and accuracy of every sample, from its text and its data row (in place)."""
        requests = [RewardRequest(p.data_source, text, p.ground_truth, bool(eos), p.extra_info,
                                  prompt=p.raw_prompt)
                    for p, text, eos in zip(batch.prompts, batch.texts, batch.finished_with_eos.tolist())]
        result = self.rewards.score(requests)
        batch.rewards = torch.tensor(result.scores, dtype=torch.float32)
        batch.acc = torch.tensor(result.accs, dtype=torch.float32)
        metrics = dict(result.metrics)
        if batch.agent is not None:  # an environment's reward wins over the reward function's
            given = ~batch.agent.env_rewards.isnan()
            batch.rewards = torch.where(given, batch.agent.env_rewards, batch.rewards)
            batch.acc = torch.where(given, (batch.agent.env_rewards > 0).float(), batch.acc)
        overlong = self.cfg.algorithm.overlong
        if overlong.shaping:  # DAPO's soft overlong punishment, on the reward only (acc stays)
            penalty = overlong_penalty(batch.response_lengths, self.cfg.rollout.response_length,
                                       overlong.buffer_length, overlong.penalty_factor)
            batch.rewards = batch.rewards + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        return metrics

    def advantages(self, batch: RolloutBatch, teacher: Ragged | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """Advantages per sequence (outcome estimators: stored once) or per token (token-level
        rewards such as KL in the reward, GAE, distillation from `teacher`'s log-probs of the
        sampled tokens), in place; returns metrics and the [N] mask of samples whose group had
        all-equal rewards."""
        algo = self.cfg.algorithm
        lengths = batch.response_lengths
        mask = batch.loss_mask.padded(max(int(lengths.max()), 1))
        rewards = batch.rewards
        metrics: dict[str, float] = {}
        if algo.use_kl_in_reward and algo.kl_coef > 0:
            width = mask.shape[1]
            rewards, kl_metrics = kl_penalized_rewards(
                rewards, batch.rollout_logprobs.padded(width), batch.ref_logprobs.padded(width), mask,
                kl_coef=algo.kl_coef, estimator=algo.kl_estimator)
            metrics.update(kl_metrics)
        values = batch.values.padded(mask.shape[1]) if batch.values is not None else None
        out = compute_advantages(algo, rewards, batch.group, mask, values=values)
        metrics.update(out.metrics)
        if out.returns is not None:  # the critic's targets
            batch.returns = Ragged.from_padded(out.returns, lengths)
        adv = out.advantages
        if teacher is not None:  # the student's log-probs are the sampler's, as in the KL reward
            width = mask.shape[1]
            student = batch.rollout_logprobs
            if student is None:  # an engine that returned no log-probs: the policy recomputes them
                student = self.policy.logprobs(batch, "current")
            adv, distill_metrics = distill_advantages(
                adv, student.padded(width), teacher.padded(width), mask,
                coef=self.cfg.distill.coef, reward_weight=self.cfg.distill.reward_weight)
            metrics.update(distill_metrics)
        first = adv.gather(1, mask.argmax(1, keepdim=True)).squeeze(1)  # at each row's first trained token
        if bool((((adv - first.unsqueeze(1)) * mask).abs() == 0).all()):
            batch.advantages = first
        else:
            batch.token_advantages = Ragged.from_padded(adv, lengths)
        return metrics, out.tied_mask

    def update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        try:
            return self.policy.update(batch, self.cfg.num_mini_batches, self.use_rollout_logprobs)
        except Exception as exc:
            if isinstance(getattr(exc, "cause", exc), NonFiniteUpdate):
                kept = complete_checkpoints(self.out)
                last = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was written yet"
                raise TrainingError(f"step {step}: {getattr(exc, 'cause', exc)}; {last}") from None
            raise

    def validate_teacher(self) -> dict[str, float]:
        """The distillation teacher's held-out accuracy, by the validation below with the
        teacher sampling (an engine loaded from distill.teacher where it lives), as
        distill/teacher_val_acc, ..._reward, ..._response_length (and ..._pass@k)."""
        out = {f"distill/teacher_{k.replace('/', '_')}": v
               for k, v in self.validate(partial(teacher_generate, self.teacher)).items()}
        logger.info("distillation teacher %s: held-out accuracy %.1f%%", self.cfg.distill.teacher,
                    100 * out["distill/teacher_val_acc"])
        return out

    def validate(self, generate: Callable[..., RolloutBatch] | None = None,
                 step: int | None = None) -> dict[str, float]:
        """Held-out accuracy (mean over val_n samples per prompt; pass@k when val_n > 1) of the
        current policy, or of whatever `generate(prompts, sampling, seeds, phase)` samples.
        `step`: the policy's training step, which names the grid of its first batch's images
        and answers (RUN_DIR/samples/step_N.png, image prompts only)."""
        generate = generate or self.topology.generate
        r = self.cfg.rollout
        sampling = SamplingParams(temperature=r.val_temperature, top_p=1.0, top_k=-1, n=r.val_n,
                                  max_tokens=r.response_length)
        accs, scores, lengths, passes = [], [], [], []
        for k, prompts in enumerate(self.val_loader.epoch_batches()):
            seeds = prompt_seeds(self.cfg.trainer.seed, 0, prompts, validation=True)
            batch = generate(prompts, sampling, seeds, "validation")
            self.score(batch)
            if k == 0 and step is not None and self.sample_images is not None:
                self.sample_images.write(step, batch)
            accs += batch.acc.tolist()
            scores += batch.rewards.tolist()
            lengths += batch.response_lengths.tolist()
            best = torch.zeros(len(prompts)).scatter_reduce(0, batch.group, batch.acc, "amax")
            passes += (best > 0).float().tolist()
        out = {"val/acc": float(np.mean(accs)), "val/reward": float(np.mean(scores)),
               "val/response_length": float(np.mean(lengths))}
        if r.val_n > 1:
            out[f"val/pass@{r.val_n}"] = float(np.mean(passes))
        return out
