"""`DataConfig`: which prompt files to train and validate on, and how to batch them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from polyrl.config import Config


class DataConfig(Config):
    train_files: list[str] = Field(default_factory=list)
    """Parquet or JSONL files in verl's schema (data_source, prompt, reward_model, extra_info),
    or Hugging Face datasets directories written by save_to_disk (DIR for a Dataset, DIR:SPLIT
    for a split of a DatasetDict; needs pip install 'polyrl[datasets]'), concatenated in order.
    A single path is accepted too."""

    val_files: list[str] = Field(default_factory=list)
    """Validation files, same schema and forms; empty disables validation."""

    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a plain string. A row without it
    but with a chat 'messages' column (TRL's conversational format) is prompted with that chat
    up to its last user turn."""

    max_prompt_length: int = Field(1024, ge=1)
    """Longest prompt in tokens (after the chat template). Longer prompts are dropped (counted
    and logged) or, with drop_overlong_prompts=false, are an error."""

    drop_overlong_prompts: bool = True
    """Drop prompts over max_prompt_length; false makes one an error naming the file and row."""

    on_bad_row: Literal["skip", "error"] = "skip"
    """A row that cannot be trained on (a prompt that is empty, renders to no tokens or is not a
    string / message list; a message without content; a line that is not JSON or not UTF-8; a
    missing data_source or reward_model.ground_truth): skip skips it, counts it and logs the file
    and row of the first few; error stops at start naming the file and row. Checked at load."""

    max_samples: int | None = Field(None, ge=1)
    """Use only the first N rows of each split (quick experiments); null uses all."""

    train_batch_size: int = Field(8, ge=1)
    """Prompts per training step (each is sampled rollout.n times)."""

    val_batch_size: int | None = Field(None, ge=1)
    """Prompts per validation batch; null puts the whole validation set in one batch."""

    shuffle: bool = True
    """Shuffle training prompts, with a fresh permutation each epoch derived from (seed, epoch)."""

    seed: int = 0
    """Seed of the shuffle; the same seed gives the same batches on every run and on resume."""

    drop_last: bool = True
    """Drop the last incomplete training batch of each epoch (so every step sees
    train_batch_size prompts); false yields it smaller."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value
