"""The run's tokenizer and data loaders, loaded from the config: what `Trainer.load_data` uses
and what `polyrl train --dry-run` reads the prompts' lengths from (`RunData`,
polyrl/topology/run_plan.py), so both plan with the same filled-in config. Imports nothing of
Ray or the workers."""

from __future__ import annotations

from typing import Any

from polyrl.builtin import resolve
from polyrl.data import build_loaders
from polyrl.job import JobConfig
from polyrl.training.model_loading import load_tokenizer


def load_run_data(cfg: JobConfig) -> tuple[Any, Any, Any]:
    """(tokenizer, training loader, validation loader or None) of `cfg`."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    data_cfg = cfg.data.model_copy(update={
        "train_files": [resolve(f) for f in cfg.data.train_files],
        "val_files": [resolve(f) for f in cfg.data.val_files]})
    train, val = build_loaders(data_cfg, tokenizer, model_dir=resolve(cfg.model.path))
    return tokenizer, train, val
