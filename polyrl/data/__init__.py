"""Prompt datasets in verl's schema (Parquet / JSONL) and a resumable, seeded batch loader.

    train, val = build_loaders(cfg, tokenizer)
    for epoch in range(train.epoch, total_epochs):
        for batch in train:               # list[PromptSample]
            ...
    checkpoint["data"] = train.state_dict()
"""

from __future__ import annotations

from typing import Any

from polyrl.data import reasoning_gym
from polyrl.data.config import DataConfig
from polyrl.data.dataset import PromptDataset, PromptSample, load_dataset, render_prompt
from polyrl.data.errors import DataFileError
from polyrl.data.files import read_rows
from polyrl.data.rows import BadRows
from polyrl.data.loader import PromptLoader


def build_loaders(cfg: DataConfig, tokenizer: Any,
                  model_dir: str | None = None) -> tuple[PromptLoader, PromptLoader | None]:
    """The training loader and, if val_files is set, the validation loader (fixed order).
    `model_dir`: the model whose image processor image rows use (default: the tokenizer's)."""
    train_set = load_dataset(cfg.train_files, tokenizer, cfg, split="train", model_dir=model_dir)
    train = PromptLoader(
        train_set, cfg.train_batch_size, shuffle=cfg.shuffle, seed=cfg.seed, drop_last=cfg.drop_last
    )
    val = None
    if cfg.val_files:
        val_set = load_dataset(cfg.val_files, tokenizer, cfg, split="val", model_dir=model_dir)
        reasoning_gym.drop_training_prompts(val_set, train_set)  # held out, though seeds collide
        val = PromptLoader(
            val_set, cfg.val_batch_size or len(val_set), shuffle=False, drop_last=False, name="val"
        )
    return train, val


__all__ = [
    "BadRows",
    "DataConfig",
    "DataFileError",
    "PromptDataset",
    "PromptLoader",
    "PromptSample",
    "build_loaders",
    "load_dataset",
    "read_rows",
    "render_prompt",
]
