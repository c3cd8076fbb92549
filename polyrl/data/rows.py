"""What makes a prompt row unusable, and the one policy applied to every such row.

A bad row found hours into a run crashes it far from its cause, so every row is checked at load:
its columns and prompt shape here (`row_problem`), its rendering and tokenisation in
`polyrl/data/dataset.py`. `data.on_bad_row` decides for all of them at once: `skip` (default)
drops the row, counts it and logs where the first few are; `error` stops at start naming the
file and row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from polyrl.data.errors import DataFileError

logger = logging.getLogger(__name__)

EXAMPLES_LOGGED = 5
"""Bad rows whose file, row and reason are logged (the rest are only counted)."""

MESSAGE_SHAPE = "a string or a non-empty list of {'role': ..., 'content': ...} messages"

MESSAGES_KEY = "messages"
"""TRL's conversational column: a whole chat, used as the prompt when the prompt column is absent."""


@dataclass
class BadRows:
    """Collects the bad rows of one split under `policy` (`data.on_bad_row`)."""

    policy: str = "error"
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, reason: str) -> None:
        """Record a bad row at `where` ("data file F row N"); raises under policy=error."""
        if self.policy == "error":
            raise DataFileError(f"{where}: {reason}; fix the row, or set data.on_bad_row=skip "
                                "to skip (and count) bad rows")
        self.count += 1
        if len(self.examples) < EXAMPLES_LOGGED:
            self.examples.append(f"{where}: {reason}")

    def log(self, name: str, total: int) -> None:
        if not self.count:
            return
        more = f" (and {self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        logger.warning("%s: skipped %d of %d rows that cannot be trained on (data.on_bad_row=skip; "
                       "set data.on_bad_row=error to stop instead):\n  %s%s",
                       name, self.count, total, "\n  ".join(self.examples), more)


def row_problem(row: dict[str, Any], prompt_key: str) -> str | None:
    """Why `row` cannot be used (one phrase), or None if its columns are usable."""
    if not isinstance(row.get("data_source"), str):
        return f"data_source must be a string, got {row.get('data_source')!r}"
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return f"reward_model must be a mapping with 'ground_truth', got {reward_model!r}"
    return prompt_problem(row.get(prompt_key), prompt_key)


def with_chat_prompt(row: dict[str, Any], prompt_key: str) -> tuple[dict[str, Any], str | None]:
    """`row` with its prompt taken from a chat `messages` column when `prompt_key` is absent
    (TRL's conversational format), plus why that chat cannot prompt, or None.

    The prompt is the chat up to and including its last user turn: the policy answers that turn,
    and what follows it (a reference answer) is not shown to it.
    """
    if prompt_key in row or MESSAGES_KEY not in row:
        return row, None
    messages = row[MESSAGES_KEY]
    if not isinstance(messages, list):
        return row, (f"'{MESSAGES_KEY}' must be a non-empty list of {{'role': ..., 'content': ...}} "
                     f"messages, got {_describe(messages)}")
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return row, f"'{MESSAGES_KEY}' has no user turn to answer"
    prompt = messages[: users[-1] + 1]
    return {**row, prompt_key: prompt}, prompt_problem(prompt, MESSAGES_KEY)


def prompt_problem(prompt: Any, prompt_key: str = "prompt") -> str | None:
    """Why `prompt` cannot be rendered into a non-empty prompt, or None."""
    if isinstance(prompt, str):
        return f"'{prompt_key}' is an empty string" if not prompt.strip() else None
    if not isinstance(prompt, list) or not prompt:
        return f"'{prompt_key}' must be {MESSAGE_SHAPE}, got {_describe(prompt)}"
    for i, message in enumerate(prompt):
        problem = _message_problem(message)
        if problem:
            return f"'{prompt_key}' message {i} {problem}"
    return None


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        hint = " (a plain prompt is one string, not a list of strings)" if isinstance(message, str) else ""
        return f"is a {type(message).__name__}, not a {{'role', 'content'}} mapping{hint}"
    if not isinstance(message.get("role"), str) or not message["role"]:
        return f"has no 'role' (got {message.get('role')!r})"
    content = message.get("content")
    if content is None:
        return "has no 'content'"
    if isinstance(content, list):  # content parts: text and images (polyrl/data/vision.py)
        return _parts_problem(content)
    if not isinstance(content, str):
        return f"has content of type {type(content).__name__}; expected a string or a list of content parts"
    if not content.strip():
        return "has empty content"
    return None


CONTENT_PART_TYPES = ("text", "image", "image_url")


def _parts_problem(parts: list[Any]) -> str | None:
    if not parts:
        return "has empty content"
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in CONTENT_PART_TYPES:
            return (f"content part {j} must be a {{'type': ...}} mapping with type one of "
                    f"{', '.join(CONTENT_PART_TYPES)}, got {part!r:.80}")
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"content part {j} is a text part without a 'text' string"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list"
    return "nothing (missing or null)" if value is None else type(value).__name__
