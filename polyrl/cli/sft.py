"""`polyrl sft`: supervised fine-tuning on chat data (docs/sft.md). With no arguments: the bundled
tiny model learns the bundled arithmetic chat file on this machine's CPU (124 steps)."""

from __future__ import annotations

import argparse
import json
import logging

from polyrl.cli.common import CLIError, add_config_args

logger = logging.getLogger("polyrl")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft", help="supervised fine-tuning on chat data (default: bundled tiny model and chat file)",
        description="Fine-tune a model on chat conversations (Parquet / JSONL in verl's SFT "
        "schemas), loss on assistant tokens only. Config: YAML files (-c) then KEY=VALUE "
        "overrides, e.g. `polyrl sft data.train_files=chat.parquet actor.lr=1e-5`. The result "
        "(checkpoints/step_*/policy) is a Hugging Face model directory for `polyrl train "
        "model.path=...`.")
    add_config_args(p)
    p.add_argument("--output-dir", help="where metrics, checkpoints and summary.json go "
                   "(same as trainer.output_dir=...)")
    p.add_argument("--print-config", action="store_true", help="print the fully resolved config and exit")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key with its default and meaning, and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="load the tokenizer and data, print what the run would do, and exit "
                   "(no weights loaded, nothing trained)")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from polyrl.config import ConfigError, describe, load_config, to_yaml
    from polyrl.sft.config import SFTConfig

    if args.help_config:
        from polyrl.sft.config import PPO_ONLY

        hidden = {f"actor.{k}" for k in PPO_ONLY}  # refused by SFTConfig: not worth listing
        for key, type_name, default, doc in describe(SFTConfig):
            if key in hidden:
                continue
            print(f"{key} ({type_name}, default {default!r})\n    {' '.join(doc.split())}")
        return 0
    if args.json and not args.dry_run:
        raise CLIError("--json only applies with --dry-run")
    if args.output_dir:
        args.overrides = [*args.overrides, f"trainer.output_dir={args.output_dir}"]
    try:
        cfg = load_config(SFTConfig, files=args.config, overrides=args.overrides)
    except ConfigError as exc:
        raise CLIError(str(exc)) from None
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    return _guarded(cfg, dry_run_json=args.json if args.dry_run else None)


def _guarded(cfg, dry_run_json: bool | None) -> int:
    """Every failure a user can cause becomes one line and exit code 2."""
    from polyrl.config import ConfigError
    from polyrl.data import DataFileError
    from polyrl.platform import PlatformError
    from polyrl.sft.launch import RankFailed
    from polyrl.sft.preflight import check_lora
    from polyrl.trainer.checkpoint import CheckpointError
    from polyrl.trainer.sinks import SinkUnavailable
    from polyrl.training.base import NonFiniteUpdate
    from polyrl.training.model_loading import ModelLoadError

    try:
        check_lora(cfg.model)  # before any rank loads the model (LoraError is a ValueError)
        if dry_run_json is not None:
            return dry_run(cfg, dry_run_json)
        return train(cfg)
    except ConfigError as exc:
        raise CLIError("; ".join(exc.problems)) from None
    except (DataFileError, ModelLoadError, NonFiniteUpdate, CheckpointError, SinkUnavailable,
            PlatformError, FileNotFoundError, ValueError, RankFailed) as exc:
        raise CLIError(str(exc)) from None


def train(cfg) -> int:
    """Train; a signal ends the run with the exit code of polyrl/trainer/interrupts.py
    `EXIT_CODES` (docs/training.md): after a checkpoint in the loop, at once during start-up
    (the same handling as `polyrl train`: cli/train.py `run_interruptible`)."""
    from polyrl.api import run_sft_job
    from polyrl.cli.train import run_interruptible
    from polyrl.config import to_yaml

    def fit() -> int:
        logger.info("resolved config:\n%s", to_yaml(cfg))
        report(run_sft_job(cfg))
        return 0

    return run_interruptible(fit)


def report(summary: dict) -> None:
    """The run's closing line: held-out loss before -> after, steps, time, where things are."""
    before, after = summary["initial_val_loss"], summary["final_val_loss"]
    where = f"model: {summary['policy_dir']}; " if summary.get("policy_dir") else ""
    if before is not None and after is not None:
        acc = summary.get("final_val_token_acc")
        print(f"held-out loss: {before:.4f} -> {after:.4f}"
              + (f" (token accuracy {acc:.1%})" if acc is not None else "")
              + f"; {summary['steps']} steps, {summary['wall_seconds']:.0f}s; {where}"
              f"metrics and summary.json in {summary['output_dir']}")
    else:
        print(f"{summary['steps']} steps, {summary['wall_seconds']:.0f}s; {where}"
              f"metrics and summary.json in {summary['output_dir']}")


def dry_run(cfg, as_json: bool) -> int:
    """What the run would train on and how, from the tokenizer, model config and data alone."""
    from transformers import AutoConfig

    from polyrl.batch import plan_micro_batches
    from polyrl.data import PromptLoader
    from polyrl.platform import get_platform
    from polyrl.sft.data import load_sft_dataset
    from polyrl.training.model_loading import load_tokenizer, model_dir

    platform = get_platform(cfg.platform)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    model_cfg = AutoConfig.from_pretrained(str(model_dir(cfg.model.path)),
                                           trust_remote_code=cfg.model.trust_remote_code)
    context = getattr(model_cfg, "max_position_embeddings", None) or cfg.data.max_length
    max_length = min(cfg.data.max_length, context)
    images_from = str(model_dir(cfg.model.path))  # image chats: the model's own image processor
    train = load_sft_dataset(cfg.data.train_files, tokenizer, cfg.data, max_length, "train", model_dir=images_from)
    val = (load_sft_dataset(cfg.data.val_files, tokenizer, cfg.data, max_length, "val", model_dir=images_from)
           if cfg.data.val_files else None)
    loader = PromptLoader(train, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                          seed=cfg.data.seed, drop_last=cfg.data.drop_last)
    steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * len(loader)
    first = [int(i) for i in loader.order(0)[: cfg.data.train_batch_size]]
    per_rank = -(-len(first) // cfg.actor.world_size)
    micro = len(plan_micro_batches(train.batch.lengths[first[:per_rank]], cfg.actor.micro_batch_tokens))
    plan = {
        "model": cfg.model.path, "platform": platform.describe(), "ranks": cfg.actor.world_size,
        "strategy": cfg.actor.strategy, "compute_dtype": cfg.actor.compute_dtype,
        "max_length": max_length, "train": train.counts("train"),
        "val": val.counts("val") if val else None, "steps": steps,
        "batches_per_epoch": len(loader), "conversations_per_step": cfg.data.train_batch_size,
        "micro_batches_per_rank_first_step": micro,
        "lora": (f"rank {cfg.model.lora_rank} on {cfg.model.lora_target_modules}" if cfg.model.enabled
                 else "off (full fine-tune)"),
        "lr": cfg.actor.lr, "lr_schedule": cfg.actor.lr_schedule, "warmup_steps": cfg.actor.warmup_steps,
        "output_dir": cfg.trainer.output_dir,
    }
    if as_json:
        print(json.dumps(plan, indent=2))
    else:
        for key, value in plan.items():
            print(f"{key:36s} {value}")
    return 0
