"""SFT data: chat files in verl's SFT schemas, encoded once at load into token ids plus an
assistant-token mask, held as one columnar `RolloutBatch` the loop selects rows from.

Schemas (`SFTDataConfig`):
    messages:        {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}],
                      "tools": [...] (optional)}
    prompt/response: {PROMPT_KEY: "question" or [messages], RESPONSE_KEY: "answer"}
                     (becomes the prompt's messages plus one assistant turn)

Each conversation becomes one batch row whose *prompt* is its first token and whose *response* is
the rest, with `loss_mask` on the assistant tokens: the training engine's forward then scores
every token after the first (polyrl/batch/micro.py `collate`), the same path RL trains on.

Every row is checked and encoded here, at load, under `data.on_bad_row` (polyrl/data/rows.py
`BadRows`): an error found at step 5000 is an error found far too late.

Image chats: a message's content may be a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image"}` / `{"type": "image_url", ...}`, with the images in the row's `images` column
(verl's schema, `<image>` placeholders in text also accepted there) or inline in the parts (a
data URL or a local path). They go through the model's image processor exactly as RL prompts do
(polyrl/data/vision.py); such a row's *prompt* then runs through its last image placeholder, so
the forward treats every placeholder as image (polyrl/training/vlm.py), and its images ride in
`RolloutBatch.images`. An assistant turn before the last image would sit in that prompt, out of
the loss, so such a row is refused rather than silently not trained on; an image chat over
data.max_length is dropped (truncation=left cannot cut images) or, with truncation=error, an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polyrl.batch import Ragged, RolloutBatch
from polyrl.builtin import resolve
from polyrl.data import BadRows, DataFileError, vision
from polyrl.data.hf_disk import load_split, parse_spec
from polyrl.sft.config import SFTDataConfig
from polyrl.sft.template import ChatEncoder, Encoded, TemplateError

logger = logging.getLogger(__name__)




def resolve_file(path: str) -> str:
    return resolve(path)


@dataclass
class SFTDataset:
    """The encoded conversations of one split and what loading them dropped or changed."""

    name: str
    batch: RolloutBatch
    where: list[str]
    """Per conversation: "data file F row N", for messages."""
    rows: int = 0
    bad_rows: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    examples: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, i: int) -> int:  # the loader hands out indices into `batch`
        return i

    @property
    def loss_tokens(self) -> int:
        return int(self.batch.loss_mask.values.sum())

    def counts(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}/conversations": len(self), f"{prefix}/bad_rows": self.bad_rows,
                f"{prefix}/dropped_overlong": self.dropped_overlong,
                f"{prefix}/truncated": self.truncated, f"{prefix}/loss_tokens": self.loss_tokens}


def prompt_length(e: Encoded, image_pad_id: int | None) -> int:
    """Tokens of the row's prompt part: the first token, or through the last image placeholder
    of an image chat (placeholders take image embeddings in the prompt only)."""
    if e.images is None or image_pad_id is None:
        return 1
    last = max(i for i, t in enumerate(e.input_ids) if t == image_pad_id)
    return max(1, last + 1)


def as_batch(encoded: Sequence[Encoded], image_pad_id: int | None = None) -> RolloutBatch:
    """Conversations as training rows: prompt = first token (an image chat: through its last
    image placeholder), response = the rest."""
    n = len(encoded)
    zeros = torch.zeros(n, dtype=torch.long)
    cut = [prompt_length(e, image_pad_id) for e in encoded]
    images = [e.images for e in encoded]
    return RolloutBatch(
        prompt_ids=Ragged.from_rows([e.input_ids[:p] for e, p in zip(encoded, cut)], torch.long),
        response_ids=Ragged.from_rows([e.input_ids[p:] for e, p in zip(encoded, cut)], torch.long),
        loss_mask=Ragged.from_rows([e.loss_mask[p:] for e, p in zip(encoded, cut)], torch.float32),
        group=torch.arange(n), stop_reason=zeros, finished_with_eos=zeros.bool(),
        weight_version=zeros, min_version=zeros, max_version=zeros, continuations=zeros,
        images=images if any(x is not None for x in images) else None)


# --- reading files -----------------------------------------------------------------------------


def read_file(path: str, cfg: SFTDataConfig, bad: BadRows) -> list[tuple[str, dict]]:
    """(where, row) of every object in a Parquet / JSONL file or a `datasets` directory (DIR or
    DIR:SPLIT, polyrl/data/hf_disk.py); unreadable lines are bad rows."""
    on_disk = parse_spec(str(resolve_file(path)))
    if on_disk is not None:
        table = load_split(*on_disk)
        rows = [(f"data file {table.label} row {i}", r) for i, r in enumerate(table.rows)]
        return _check_columns(table.label, rows, set(table.columns), cfg)
    p = Path(resolve_file(path)).expanduser()
    if p.is_dir():
        raise DataFileError(f"data file {p} is a directory; list the .parquet / .jsonl files inside it")
    if not p.is_file():
        raise DataFileError(f"data file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except (pa.ArrowException, OSError) as exc:
            raise DataFileError(f"data file {p} is not a readable parquet file: {exc}") from None
        rows = [(f"data file {p} row {i}", r) for i, r in enumerate(table.to_pylist())]
        columns = set(table.column_names)
    elif suffix in (".jsonl", ".json"):
        rows = []
        for no, line in enumerate(p.read_bytes().splitlines(), 1):
            where = f"data file {p} line {no}"
            if not line.strip():
                continue
            try:
                value = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                bad.add(where, f"not a UTF-8 JSON line ({type(exc).__name__}: {exc})")
                continue
            if isinstance(value, dict):
                rows.append((where, value))
            else:
                bad.add(where, f"expected a JSON object, got {type(value).__name__}")
        columns = set().union(*(r.keys() for _, r in rows)) if rows else set()
    else:
        raise DataFileError(f"data file {p}: unsupported format '{suffix}'; use .parquet or .jsonl")
    rows = [(where, vision.anchor_image_paths(r, p.parent)) for where, r in rows]  # the data file's
    return _check_columns(p, rows, columns, cfg)


def _check_columns(p: Any, rows: list[tuple[str, dict]], columns: set[str],
                   cfg: SFTDataConfig) -> list[tuple[str, dict]]:
    """The rows, once the columns the configured schema reads are there (an error names them)."""
    needed = [cfg.prompt_key, cfg.response_key] if cfg.prompt_key else [cfg.messages_key]
    missing = [c for c in needed if c not in columns]
    if missing and columns:
        hint = ("set data.messages_key, or data.prompt_key and data.response_key for the "
                "prompt/response schema") if not cfg.prompt_key else "check data.prompt_key / data.response_key"
        raise DataFileError(f"data file {p} lacks column(s) {', '.join(missing)} (has "
                            f"{', '.join(sorted(columns))}); {hint}")
    return rows


def conversation(row: dict, cfg: SFTDataConfig) -> tuple[list[dict], list | None]:
    """(messages, tools) of a row; raises TemplateError naming what is wrong with it."""
    if cfg.prompt_key:
        prompt, response = row.get(cfg.prompt_key), row.get(cfg.response_key)
        if not isinstance(response, str) or not response:
            raise TemplateError(f"'{cfg.response_key}' must be a non-empty string, got {_kind(response)}")
        if isinstance(prompt, str) and prompt:
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            messages = list(prompt)
        else:
            raise TemplateError(f"'{cfg.prompt_key}' must be a string or a list of messages, got {_kind(prompt)}")
        messages = messages + [{"role": "assistant", "content": response}]
        key = cfg.prompt_key
    else:
        messages, key = row.get(cfg.messages_key), cfg.messages_key
        if not isinstance(messages, list) or not messages:
            raise TemplateError(f"'{key}' must be a non-empty list of {{role, content}} messages, "
                                f"got {_kind(messages)}")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TemplateError(f"'{key}' message {i} is a {type(m).__name__}, not a {{role, content}} mapping")
        m = vision.flatten_text_parts({k: v for k, v in m.items() if v is not None})  # parquet: every field
        role = m.get("role")
        if role not in cfg.roles:
            raise TemplateError(f"'{key}' message {i} has role {role!r}, not one of "
                                f"{', '.join(cfg.roles)} (data.roles)")
        if not isinstance(m.get("content"), (str, list)) and not m.get("tool_calls"):
            raise TemplateError(f"'{key}' message {i} ({role}) has no string content or content parts")
        clean.append(m)
    if not any(m["role"] == "assistant" for m in clean):
        raise TemplateError(f"'{key}' has no assistant turn (nothing to train on)")
    tools = row.get(cfg.tools_key)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            raise TemplateError(f"'{cfg.tools_key}' is a string but not JSON: {exc}") from None
    if tools is not None and not isinstance(tools, list):
        raise TemplateError(f"'{cfg.tools_key}' must be a list of tool schemas, got {_kind(tools)}")
    return clean, tools or None


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (missing or null)"
    if isinstance(value, (str, list)) and not value:
        return f"an empty {type(value).__name__}"
    return type(value).__name__


# --- encoding and the length limit -------------------------------------------------------------


def fit(encoder: ChatEncoder, messages: list[dict], tools: list | None, max_length: int,
        truncation: str, where: str) -> tuple[Encoded | None, bool]:
    """The encoded conversation within `max_length` tokens and whether turns were removed
    (None: dropped as over-long).

    The length is measured first, from one render (`ChatEncoder.count_tokens`); only a
    conversation that fits is encoded with its assistant mask (a render per assistant turn, so
    its cost is bounded by max_length, never by the row). The work on an over-long row is
    therefore linear in its size, and left truncation probes suffixes from the newest turn
    backwards (`first_fitting`) instead of re-encoding once per dropped turn."""
    length = encoder.count_tokens(messages, tools)
    if length <= max_length:
        return encoder.encode(messages, tools), False
    if truncation == "error":
        raise DataFileError(f"{where}: the conversation has {length} tokens > "
                            f"data.max_length={max_length}; raise it, or set data.truncation=drop "
                            "(skip such rows) or left (remove the oldest turns)")
    if truncation == "drop":
        return None, False
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1  # the system prompt stays: it conditions every turn
    # where a shortened conversation may start: a user message, after dropping at least one turn
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]

    def kept(k: int) -> list[dict]:
        return messages[:head] + messages[starts[k]:]

    k = first_fitting(len(starts), lambda k: encoder.count_tokens(kept(k), tools) <= max_length)
    if k is None or not any(m["role"] == "assistant" for m in messages[starts[k]:]):
        return None, False  # even the last exchange is too long, or no assistant turn is left
    return encoder.encode(kept(k), tools), True


def first_fitting(n: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest k in [0, n) with fits(k), for a `fits` that turns true and stays true as k
    grows (a later start keeps fewer turns); None if fits(n - 1) is false. Gallops from the
    end (n-1, n-2, n-4, ...) and then bisects, so it probes O(log) suffixes no longer than about
    twice the answer."""
    if n == 0 or not fits(n - 1):
        return None
    good, step = n - 1, 1
    while True:
        probe = good - step
        if probe < 0:
            bad = -1
            break
        if not fits(probe):
            bad = probe
            break
        good, step = probe, step * 2
    while good - bad > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def load_sft_dataset(files: Sequence[str], tokenizer: Any, cfg: SFTDataConfig, max_length: int,
                     split: str = "train", model_dir: str | None = None) -> SFTDataset:
    """`model_dir`: where image chats find the image processor (default: the tokenizer's)."""
    key = f"data.{split}_files"
    if not files:
        raise DataFileError(f"{key} is empty; set {key}=[path/to/{split}.parquet]")
    encoder = ChatEncoder(tokenizer)
    images = ImageChats(tokenizer, model_dir)
    bad = BadRows(cfg.on_bad_row)
    rows = [r for f in files for r in read_file(f, cfg, bad)]
    if cfg.max_samples is not None:
        rows = rows[: cfg.max_samples]
    name = ", ".join(files)
    out = SFTDataset(name=name, batch=as_batch([]), where=[], rows=len(rows) + bad.count)
    encoded = []
    for where, row in rows:
        try:
            messages, tools = conversation(row, cfg)
            if images.has_images(row, messages):
                enc, truncated = images.encode(encoder, row, messages, tools, max_length, cfg.truncation, where)
            else:
                enc, truncated = fit(encoder, messages, tools, max_length, cfg.truncation, where)
        except (TemplateError, vision.ImageRowError) as exc:
            bad.add(where, str(exc))
            continue
        if enc is None:
            out.dropped_overlong += 1
            continue
        cut = prompt_length(enc, images.pad_id)
        if sum(enc.loss_mask[:cut]) and cut > 1:
            bad.add(where, "an assistant turn comes before the last image; polyrl sft trains image "
                           "chats whose images all come before the first assistant turn")
            continue
        if sum(enc.loss_mask[cut:]) == 0:  # only the first token is assistant: nothing is predicted
            bad.add(where, "no assistant token after the first token")
            continue
        out.truncated += truncated
        encoded.append(enc)
        out.where.append(where)
    out.bad_rows = bad.count
    out.batch = as_batch(encoded, images.pad_id)
    bad.log(name, out.rows)
    if out.dropped_overlong or out.truncated:
        logger.warning("%s: %d of %d conversations over data.max_length=%d tokens: %d dropped, "
                       "%d shortened by removing their oldest turns (data.truncation=%s)", name,
                       out.dropped_overlong + out.truncated, out.rows, max_length,
                       out.dropped_overlong, out.truncated, cfg.truncation)
    if not encoded:
        raise DataFileError(f"{name}: no conversations left of {out.rows} rows ({out.bad_rows} bad, "
                            f"{out.dropped_overlong} over data.max_length={max_length})"
                            + (f", e.g. {bad.examples[0]}" if bad.examples else ""))
    return out


class ImageChats:
    """Image chats of one load: the model's image processor (polyrl/data/vision.py), loaded on
    the first image row, so text-only data never needs one."""

    def __init__(self, tokenizer: Any, model_dir: str | None):
        self.tokenizer = tokenizer
        self.model_dir = model_dir or getattr(tokenizer, "name_or_path", None)
        self.prompter: vision.VisionPrompter | None = None

    @property
    def pad_id(self) -> int | None:
        return self.prompter.image_pad_id if self.prompter is not None else None

    @staticmethod
    def has_images(row: dict, messages: list[dict]) -> bool:
        if row.get(vision.IMAGES_KEY) is not None:
            return True
        return any(isinstance(p, dict) and p.get("type") in vision.IMAGE_PARTS
                   for m in messages if isinstance(m.get("content"), list) for p in m["content"])

    def encode(self, encoder: ChatEncoder, row: dict, messages: list[dict], tools: list | None,
               max_length: int, truncation: str, where: str) -> tuple[Encoded | None, bool]:
        """The conversation with its images, placeholders expanded (None: over max_length and
        dropped; images cannot be cut, so truncation=left drops too)."""
        if self.prompter is None:
            self.prompter = vision.VisionPrompter.from_model_dir(self.model_dir, self.tokenizer)
        messages, inline = vision.with_image_parts(messages, placeholders=row.get(vision.IMAGES_KEY) is not None)
        pictures = [vision.open_image(entry) for entry in vision.images_for(row, inline)]
        enc = encoder.encode(messages, tools)
        inputs = self.prompter.process(pictures)
        ids, mask = self.prompter.expand(enc.input_ids, inputs, enc.loss_mask)
        if len(ids) > max_length:
            if truncation == "error":
                raise DataFileError(f"{where}: the conversation has {len(ids)} tokens (its images "
                                    f"expanded) > data.max_length={max_length}; raise it, or set "
                                    "data.truncation=drop (skip such rows)")
            return None, False
        return Encoded(ids, mask, inputs), False
