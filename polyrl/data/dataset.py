"""Prompts ready for rollout: rendered with the chat template, tokenised, over-long ones dropped.

Message-list prompts go through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
and are tokenised without adding special tokens (the template already has them); plain-string
prompts are used as-is and tokenised like `tokenizer(text)` (so a base model still gets its BOS).

Every row is rendered and tokenised here, at load: a row whose template fails or that renders to
zero tokens is a bad row (`data.on_bad_row`, polyrl/data/rows.py) found before training starts,
not when its batch comes up hours later.

A row with images (an `images` column, or image content parts) goes through the model's image
processor (polyrl/data/vision.py): its ids hold the expanded image placeholders and its
`PromptSample.images` the pixel patches; an unreadable image or a placeholder count that does not
match the images is a bad row. Text-only rows never touch the image processor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from polyrl.data import vision
from polyrl.data.config import DataConfig
from polyrl.data.errors import DataFileError
from polyrl.data.files import read_source_rows
from polyrl.data.multimodal import ImageInputs
from polyrl.data.rows import EXAMPLES_LOGGED, BadRows, row_problem

logger = logging.getLogger(__name__)


@dataclass
class PromptSample:
    index: int
    """Row number among the split's readable rows (files concatenated, before the prompt checks
    and the length filter): a stable prompt id, usable as the GRPO group id."""
    data_source: str
    prompt_ids: list[int]
    prompt_text: str
    """The prompt after the chat template (what `prompt_ids` encode)."""
    raw_prompt: str | list[dict[str, Any]]
    """The prompt as stored: messages (for chat-completion style rollouts) or a string."""
    ground_truth: Any
    extra_info: dict[str, Any] | None = None
    images: ImageInputs | None = None
    """The prompt's images as the model's processor made them (their placeholders are already
    expanded in `prompt_ids`); None for a text-only prompt."""


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
    messages = [vision.flatten_text_parts({k: v for k, v in m.items() if v is not None}) for m in prompt]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class PromptDataset(Sequence[PromptSample]):
    """An in-memory list of tokenised prompts; `num_dropped_overlong`, `num_bad_rows` and
    `num_null_ground_truth` feed the metrics and the start-up log."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        drop_overlong_prompts: bool = True,
        name: str = "<rows>",
        where: Sequence[str] | None = None,
        bad_rows: BadRows | None = None,
        model_dir: str | None = None,
    ):
        self.name = name
        self._model_dir = model_dir
        self._prompter = None  # built on the first image row: text-only data never loads it
        self.prompt_key = prompt_key
        self.bad_rows = bad_rows if bad_rows is not None else BadRows("error")
        where = list(where) if where is not None else [f"{name} row {i}" for i in range(len(rows))]
        bad_in_files = self.bad_rows.count  # rows the file readers already skipped
        usable = self._usable(rows, where, tokenizer)
        self.samples: list[PromptSample] = []
        self.num_dropped_overlong = 0
        null_truth: list[str] = []
        for i, row, text, prompt_ids, images in usable:
            if len(prompt_ids) > max_prompt_length:
                if not drop_overlong_prompts:
                    of_images = (f" ({sum(images.num_placeholder_tokens(self._prompter.merge_size))} "
                                 "of them image tokens)") if images is not None else ""
                    raise DataFileError(
                        f"{where[i]}: prompt has {len(prompt_ids)} tokens{of_images} > "
                        f"data.max_prompt_length={max_prompt_length}; raise the limit or set "
                        "data.drop_overlong_prompts=true"
                    )
                self.num_dropped_overlong += 1
                continue
            if row["reward_model"]["ground_truth"] is None:
                null_truth.append(where[i])
            self.samples.append(PromptSample(
                index=i,
                data_source=row["data_source"],
                prompt_ids=prompt_ids,
                prompt_text=text,
                raw_prompt=row[prompt_key],
                ground_truth=row["reward_model"]["ground_truth"],
                extra_info=row.get("extra_info"),
                images=images,
            ))
        self.num_bad_rows = self.bad_rows.count
        self.num_null_ground_truth = len(null_truth)
        self._report(len(rows) + bad_in_files, max_prompt_length, null_truth)

    def _usable(self, rows, where, tokenizer) -> list[tuple[int, dict, str, list[int], ImageInputs | None]]:
        """(index, row, rendered text, token ids, images) of every row that renders to >= 1 token."""
        rendered: list[tuple[int, dict, str]] = []
        encoded: dict[int, tuple[list[int], ImageInputs | None]] = {}  # image rows, tokenised one by one
        for i, row in enumerate(rows):
            problem = row_problem(row, self.prompt_key)
            text = None
            if problem is None:
                try:
                    if vision.has_images(row, self.prompt_key):
                        text, encoded[i] = self._encode_image_row(row, tokenizer)
                    else:
                        text = render_prompt(tokenizer, row[self.prompt_key])
                except vision.ImageRowError as exc:
                    problem = str(exc)
                except DataFileError:
                    raise  # the model cannot take images at all: not one row's problem
                except Exception as exc:  # a template error is the row's problem, not the run's
                    if getattr(tokenizer, "chat_template", None) is None:
                        raise
                    problem = f"the chat template fails on this prompt: {type(exc).__name__}: {exc}"
            if problem:
                self.bad_rows.add(where[i], problem)
            else:
                rendered.append((i, row, text))
        plain = [(i, row, text) for i, row, text in rendered if i not in encoded]
        is_chat = [not isinstance(row[self.prompt_key], str) for _, row, _ in plain]
        for (i, _, _), ids in zip(plain, _tokenize(tokenizer, [text for _, _, text in plain], is_chat)):
            encoded[i] = (ids, None)
        usable = []
        for i, row, text in rendered:
            prompt_ids, images = encoded[i]
            if prompt_ids:
                usable.append((i, row, text, prompt_ids, images))
            else:
                self.bad_rows.add(where[i], f"the prompt renders to 0 tokens ({text!r})")
        return usable

    def _encode_image_row(self, row: dict, tokenizer: Any) -> tuple[str, tuple[list[int], ImageInputs | None]]:
        if self._prompter is None:
            model_dir = self._model_dir or getattr(tokenizer, "name_or_path", None)
            self._prompter = vision.VisionPrompter.from_model_dir(model_dir, tokenizer)
        if isinstance(row[self.prompt_key], str):
            raise vision.ImageRowError(f"a row with images needs a chat prompt (a message list) in "
                                       f"'{self.prompt_key}', so the chat template places the images")
        messages, inline = vision.with_image_parts(row[self.prompt_key],
                                                   placeholders=row.get(vision.IMAGES_KEY) is not None)
        images = [vision.open_image(entry) for entry in vision.images_for(row, inline)]
        text = render_prompt(tokenizer, messages)
        return text, self._prompter.encode(text, images)

    def _report(self, total: int, max_prompt_length: int, null_truth: list[str]) -> None:
        self.bad_rows.log(self.name, total)
        if self.num_dropped_overlong:
            logger.warning(
                "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                self.name, self.num_dropped_overlong, total, max_prompt_length,
            )
        if null_truth:
            logger.warning(
                "%s: %d of %d rows have reward_model.ground_truth null (%s%s): the built-in "
                "verifiers score them 0 and count them in reward/null_ground_truth; fill in the "
                "answers, or score these rows with reward.custom_function",
                self.name, len(null_truth), total, ", ".join(null_truth[:EXAMPLES_LOGGED]),
                ", ..." if len(null_truth) > EXAMPLES_LOGGED else "",
            )
        if not self.samples:
            raise DataFileError(self._nothing_left(total, max_prompt_length))

    def _nothing_left(self, total: int, max_prompt_length: int) -> str:
        if not total:
            return f"{self.name}: no rows"
        if self.num_bad_rows == total:
            return (f"{self.name}: no prompts left: all {total} rows are bad (data.on_bad_row=skip), "
                    f"e.g. {self.bad_rows.examples[0] if self.bad_rows.examples else '?'}")
        return (f"{self.name}: no prompts left: all {total} were dropped by data.max_prompt_length="
                f"{max_prompt_length} (tokens) or as bad rows; raise the limit")

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


def load_dataset(files: Sequence[str], tokenizer: Any, cfg: DataConfig, split: str = "train",
                 model_dir: str | None = None) -> PromptDataset:
    """Read, concatenate, check, render and filter the files of one split. `model_dir`: where
    image rows find the image processor (default: the tokenizer's directory)."""
    key = f"data.{split}_files"
    if not files:
        raise DataFileError(f"{key} is empty; set {key}=[path/to/{split}.parquet]")
    bad_rows = BadRows(cfg.on_bad_row)
    rows = []
    for f in files:
        rows.extend(read_source_rows(f, cfg.prompt_key, bad_rows))
    if cfg.max_samples is not None:
        rows = rows[: cfg.max_samples]
    return PromptDataset(
        [r.data for r in rows],
        tokenizer,
        prompt_key=cfg.prompt_key,
        max_prompt_length=cfg.max_prompt_length,
        drop_overlong_prompts=cfg.drop_overlong_prompts,
        name=", ".join(str(f) for f in files),
        where=[r.where for r in rows],
        bad_rows=bad_rows,
        model_dir=model_dir,
    )
