"""The SFT loop on one rank: load -> (resume) -> validate -> steps (validate, log, checkpoint) ->
validate -> summary.json.

Every rank runs this same loop on its shard of each batch (`split_evenly`), so the engine's
collectives line up; only rank 0 writes metrics, checkpoints' driver state and the summary.
Checkpoints use the RL layout (polyrl/trainer/checkpoint.py): `policy/` is a Hugging Face model
directory with the tokenizer, directly usable as `model.path` of `polyrl train` (with
`model.lora_rank`, the merged model, and the adapter in `policy_adapter/`, as RL writes them).
Ctrl-C / SIGTERM finish the current step and checkpoint (trainer/interrupts.py `stop_on_signals`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from polyrl.batch import split_evenly
from polyrl.config import to_yaml
from polyrl.data import PromptLoader
from polyrl.data.vision import copy_processor_files
from polyrl.modeling import seed_everything
from polyrl.platform import get_platform
from polyrl.sft.config import SFTConfig
from polyrl.sft.data import SFTDataset, load_sft_dataset
from polyrl.sft.step import evaluate, train_step
from polyrl.trainer.checkpoint import (
    CheckpointError, CheckpointWriter, capture_rng, check_writable,
    checkpoint_root, read_resume_point, restore_rng, step_dir,
)
from polyrl.trainer.interrupts import TrainingInterrupted, stop_on_signals
from polyrl.trainer.sinks import build_sinks, check_available, close_all, log_all
from polyrl.training import build_engine
from polyrl.training.lora import apply_lora
from polyrl.modeling import torch_dtype
from polyrl.training import vlm
from polyrl.training.model_loading import load_causal_lm, load_tokenizer, model_dir

logger = logging.getLogger(__name__)

class SFTTrainer:
    def __init__(self, cfg: SFTConfig, rank: int = 0, world_size: int = 1, group: Any = None,
                 local_device: int = 0):
        self.cfg, self.rank, self.world_size, self.group = cfg, rank, world_size, group
        self.out = cfg.output_path
        self.platform = get_platform(cfg.platform)
        self.device = self.platform.torch_device(local_device)
        self.start_time = time.perf_counter()

    # --- set-up -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if self.rank == 0:
            check_available(cfg.logging.sinks)
            check_writable(self.out, need_bytes=0)
            (self.out / "config.yaml").write_text(to_yaml(cfg))
        seed_everything(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
        self.model_dir = model_dir(cfg.model.path)
        if vlm.is_vlm_dir(self.model_dir):  # image chats: the vision tower trains with model.train_vision_tower
            model = vlm.load_vlm(self.model_dir, torch_dtype(cfg.actor.param_dtype), cfg.model.trust_remote_code,
                                 train_vision_tower=cfg.model.train_vision_tower)
        else:
            model = load_causal_lm(cfg.model.path, cfg.actor.param_dtype, cfg.model.trust_remote_code)
        actor_cfg = cfg.actor
        if cfg.model.enabled:  # LoRA exactly as a policy rank applies it (workers/policy.py)
            model = apply_lora(model, cfg.model)
            actor_cfg = actor_cfg.model_copy(update={"lr": cfg.actor.lr * cfg.model.lora_lr_scale})
        text_config = getattr(model.config, "text_config", None) or model.config  # a VLM's is nested
        context = getattr(text_config, "max_position_embeddings", None) or cfg.data.max_length
        self.max_length = min(cfg.data.max_length, context)
        self.train_set = load_sft_dataset(cfg.data.train_files, self.tokenizer, cfg.data, self.max_length, "train",
                                          model_dir=str(self.model_dir))
        self.val_set: SFTDataset | None = None
        if cfg.data.val_files:
            self.val_set = load_sft_dataset(cfg.data.val_files, self.tokenizer, cfg.data, self.max_length, "val",
                                            model_dir=str(self.model_dir))
        self.loader = PromptLoader(self.train_set, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed, drop_last=cfg.data.drop_last)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * len(self.loader)
        if cfg.actor.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.engine = build_engine(model.to(self.device), actor_cfg, self.platform, self.device,
                                   rank=self.rank, world_size=self.world_size, group=self.group,
                                   horizon=self.total_steps)
        self.checkpoints = CheckpointWriter(self.out, cfg.trainer.keep_last)
        if self.rank == 0:
            check_writable(self.out, self.engine.num_params * 12 * (cfg.trainer.keep_last + 1))
            logger.info("sft: %s (%.2fM parameters) on %s, %d rank(s); %d conversations (%d loss "
                        "tokens), %d steps of %d", cfg.model.path, self.engine.num_params / 1e6,
                        self.platform.describe(), self.world_size, len(self.train_set),
                        self.train_set.loss_tokens, self.total_steps, cfg.data.train_batch_size)

    def _my_share(self, indices: list[int]) -> list[int]:
        return split_evenly(indices, self.world_size)[self.rank]

    def validate(self) -> dict[str, float]:
        assert self.val_set is not None
        rows = self._my_share(list(range(len(self.val_set))))
        return evaluate(self.engine, self.val_set.batch.select(rows), self.device,
                        self.cfg.actor.micro_batch_tokens)

    # --- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.setup()
        state = self.resume_or_start()
        first = state["step"] + 1
        sinks = []
        if self.rank == 0:
            sinks = build_sinks(cfg.logging.sinks, self.out, cfg.logging.run_name or self.out.resolve().name,
                                cfg.model_dump(mode="json"), wandb_mode=cfg.logging.wandb_mode,
                                wandb_project=cfg.logging.wandb_project, resume_step=state["step"] or None)
        bar = self._progress_bar(state["step"])
        initial, final, final_step = state.get("initial_val"), None, None
        try:
            with stop_on_signals() as stop:  # Ctrl-C / SIGTERM: finish the step, checkpoint, stop
                if first == 1:
                    data_counts = {**self.train_set.counts("data/train"),
                                   **(self.val_set.counts("data/val") if self.val_set else {})}
                    if self.val_set is not None and cfg.trainer.val_before_train:
                        initial = self.validate()
                    log_all(sinks, 0, {**data_counts, **(initial or {})})
                for step in range(first, self.total_steps + 1):
                    metrics = self._train_step()
                    if self.val_set is not None and cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                        final, final_step = self.validate(), step
                        metrics.update(final)
                    if step % cfg.trainer.log_every == 0 or step == self.total_steps or final_step == step:
                        log_all(sinks, step, metrics)
                    if bar is not None:
                        bar.set_postfix({k.split("/")[-1]: f"{v:.4f}" for k, v in metrics.items()
                                         if k in ("train/loss", "val/loss")}, refresh=False)
                        bar.update(1)
                    last, signum = step == self.total_steps, self._agreed_signal(stop.signum)
                    due = ((cfg.trainer.save_every and step % cfg.trainer.save_every == 0)
                           or (last and cfg.trainer.save_at_end))
                    if due or (signum and cfg.trainer.save_on_interrupt):
                        self.save(step, initial)
                    if signum and not last:
                        raise TrainingInterrupted(self._stopped_message(step), 128 + signum)
            if self.val_set is not None and final_step != self.total_steps:
                final = self.validate()
                log_all(sinks, self.total_steps, final)
        finally:
            if bar is not None:
                bar.close()
            close_all(sinks)
        return self._summary(initial, final, state)

    def _train_step(self) -> dict[str, float]:
        rows = self._my_share([int(i) for i in self.loader.next_batch()])
        metrics = train_step(self.engine, self.train_set.batch.select(rows), self.device,
                             self.cfg.actor.micro_batch_tokens)
        metrics["train/epoch"] = self.loader.epoch + self.loader.position / len(self.loader)
        return metrics

    def _agreed_signal(self, signum: int | None) -> int:
        """The stop signal any rank received (0: none), the same on every rank, so all ranks
        checkpoint and stop after the same step (a signal reaches ranks at different moments)."""
        if self.world_size == 1:
            return signum or 0
        return int(self.engine.all_reduce(torch.tensor([float(signum or 0)]), op="max").item())

    def _stopped_message(self, step: int) -> str:
        where = (f"wrote checkpoint {step_dir(self.out, step)}" if self.cfg.trainer.save_on_interrupt
                 else "wrote no checkpoint (trainer.save_on_interrupt=false)")
        return (f"stopped after step {step} of {self.total_steps}; {where}. Continue with the same "
                "command (trainer.resume=auto).")

    def _progress_bar(self, done: int):
        if self.rank != 0 or not self.cfg.trainer.progress_bar:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=done, desc="polyrl sft", unit="step", dynamic_ncols=True)

    def _summary(self, initial: dict | None, final: dict | None, state: dict) -> dict[str, Any]:
        last = step_dir(self.out, self.total_steps) / "policy"
        summary = {
            "initial_val_loss": initial.get("val/loss") if initial else None,
            "final_val_loss": final.get("val/loss") if final else None,
            "initial_val_token_acc": initial.get("val/token_acc") if initial else None,
            "final_val_token_acc": final.get("val/token_acc") if final else None,
            "steps": self.total_steps,
            "epochs": round(self.total_steps / len(self.loader), 3),
            **self.train_set.counts("train"),
            **(self.val_set.counts("val") if self.val_set else {}),
            "wall_seconds": round(time.perf_counter() - self.start_time + state.get("wall_seconds", 0.0), 2),
            "output_dir": str(self.out),
            "policy_dir": str(last) if last.is_dir() else None,
        }
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            if self.cfg.logging.plot_at_end:
                try:
                    from polyrl.trainer.plots import plot_run

                    logger.info("curves: %s (redraw any time: polyrl plot %s)", plot_run(self.out), self.out)
                except Exception as exc:  # a plotting problem must not fail a finished run
                    logger.warning("could not draw the curves: %s", exc)
        return summary

    # --- checkpoints --------------------------------------------------------------------------
    def _barrier(self) -> None:
        self.engine.all_reduce(torch.zeros(1))

    def save(self, step: int, initial_val: dict | None) -> None:
        tmp = checkpoint_root(self.out) / f".tmp-step_{step:06d}"
        try:
            if self.rank == 0:
                tmp = self.checkpoints.begin(step)
            self._barrier()  # the directory exists before any rank writes into it
            self.engine.save(tmp)
            torch.save({"torch_rng": torch.get_rng_state()}, tmp / f"rank{self.rank}.pt")
            self._barrier()
            if self.rank == 0:
                self.tokenizer.save_pretrained(str(tmp / "policy"))
                copy_processor_files(self.model_dir, tmp / "policy")  # a VLM's policy/ takes images too
                driver = {"step": step, "data": self.loader.state_dict(), "rng": capture_rng(),
                          "initial_val": initial_val,
                          "wall_seconds": time.perf_counter() - self.start_time}
                self.checkpoints.commit(tmp, step, driver, self.cfg.model_dump(mode="json"))
            self._barrier()
        except OSError as exc:
            if self.rank == 0:
                self.checkpoints.abort(tmp)
            raise CheckpointError(f"could not write the checkpoint of step {step} ({exc})") from None

    def resume_or_start(self) -> dict[str, Any]:
        found = read_resume_point(self.cfg.trainer.resume, self.out, self.cfg.model_dump(mode="json"))
        if found is None:
            return {"step": 0}
        resume_dir, state, changed = found
        if changed and self.rank == 0:
            logger.info("resuming with changed settings (allowed): %s", ", ".join(changed))
        if state["step"] > self.total_steps:
            raise CheckpointError(f"{resume_dir} is past this run's last step ({self.total_steps}); "
                                  "raise trainer.total_steps or start fresh with trainer.resume=off")
        self.engine.load(resume_dir)
        self.loader.load_state_dict(state["data"])
        restore_rng(state["rng"])
        rank_file = Path(resume_dir) / f"rank{self.rank}.pt"
        torch.set_rng_state(torch.load(rank_file, weights_only=False)["torch_rng"])
        if self.rank == 0:
            logger.info("resumed from %s (step %d)", resume_dir, state["step"])
        return state
