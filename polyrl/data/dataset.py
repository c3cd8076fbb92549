"""Prompts ready for rollout: rendered with the chat template, tokenised, over-long ones dropped.

Message-list prompts go through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
and are tokenised without adding special tokens (the template already has them); plain-string
prompts are used as-is and tokenised like `tokenizer(text)` (so a base model still gets its BOS).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from polyrl.data.config import DataConfig
from polyrl.data.files import DataFileError, read_rows

logger = logging.getLogger(__name__)


@dataclass
class PromptSample:
    index: int
    """Row number in the split's files (concatenated, before filtering): a stable prompt id,
    usable as the GRPO group id."""
    data_source: str
    prompt_ids: list[int]
    prompt_text: str
    """The prompt after the chat template (what `prompt_ids` encode)."""
    raw_prompt: str | list[dict[str, Any]]
    """The prompt as stored: messages (for chat-completion style rollouts) or a string."""
    ground_truth: Any
    extra_info: dict[str, Any] | None = None


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> str:
    """Apply the chat template to a message list; return a plain string unchanged."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "prompts are chat message lists but the tokenizer has no chat template; use a "
            "tokenizer with a chat_template (an instruct model) or store prompts as plain strings"
        )
    # parquet structs give every message every field; drop the unset ones (e.g. name=None)
    messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class PromptDataset(Sequence[PromptSample]):
    """An in-memory list of tokenised prompts; `num_dropped_overlong` feeds the metrics."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        drop_overlong_prompts: bool = True,
        name: str = "<rows>",
    ):
        self.name = name
        texts = [render_prompt(tokenizer, row[prompt_key]) for row in rows]
        is_chat = [not isinstance(row[prompt_key], str) for row in rows]
        ids = _tokenize(tokenizer, texts, is_chat)
        self.samples: list[PromptSample] = []
        self.num_dropped_overlong = 0
        for i, (row, text, prompt_ids) in enumerate(zip(rows, texts, ids)):
            if len(prompt_ids) > max_prompt_length:
                if not drop_overlong_prompts:
                    raise DataFileError(
                        f"{name} row {i}: prompt has {len(prompt_ids)} tokens > "
                        f"data.max_prompt_length={max_prompt_length}; raise the limit or set "
                        "data.drop_overlong_prompts=true"
                    )
                self.num_dropped_overlong += 1
                continue
            self.samples.append(PromptSample(
                index=i,
                data_source=row["data_source"],
                prompt_ids=prompt_ids,
                prompt_text=text,
                raw_prompt=row[prompt_key],
                ground_truth=row["reward_model"]["ground_truth"],
                extra_info=row.get("extra_info"),
            ))
        if self.num_dropped_overlong:
            logger.warning(
                "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                name, self.num_dropped_overlong, len(rows), max_prompt_length,
            )
        if not self.samples:
            raise DataFileError(
                f"{name}: no prompts left: all {len(rows)} were dropped by "
                f"data.max_prompt_length={max_prompt_length} (tokens); raise it"
                if rows else f"{name}: no rows"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.samples[i]

    @property
    def data_sources(self) -> set[str]:
        return {s.data_source for s in self.samples}


def _tokenize(tokenizer: Any, texts: list[str], is_chat: list[bool]) -> list[list[int]]:
    """Batch-tokenise; chat-rendered texts without extra special tokens."""
    out: list[list[int]] = [[] for _ in texts]
    for chat in (True, False):
        idx = [i for i, c in enumerate(is_chat) if c is chat]
        if idx:
            enc = tokenizer([texts[i] for i in idx], add_special_tokens=not chat)["input_ids"]
            for i, ids in zip(idx, enc):
                out[i] = list(ids)
    return out


def load_dataset(files: Sequence[str], tokenizer: Any, cfg: DataConfig, split: str = "train") -> PromptDataset:
    """Read, concatenate, render and filter the files of one split."""
    key = f"data.{split}_files"
    if not files:
        raise DataFileError(f"{key} is empty; set {key}=[path/to/{split}.parquet]")
    rows: list[dict[str, Any]] = []
    for f in files:
        rows.extend(read_rows(f, cfg.prompt_key))
    if cfg.max_samples is not None:
        rows = rows[: cfg.max_samples]
    return PromptDataset(
        rows,
        tokenizer,
        prompt_key=cfg.prompt_key,
        max_prompt_length=cfg.max_prompt_length,
        drop_overlong_prompts=cfg.drop_overlong_prompts,
        name=", ".join(str(f) for f in files),
    )
