"""A conversation's token ids and its assistant-token mask, from the model's own chat template.

The loss must cover exactly what the model will be asked to produce at inference: each assistant
turn as the template renders it (content plus the template's end-of-turn marker), never the
generation prompt (`<|im_start|>assistant\\n`) that the inference-time template supplies itself.
Two ways to find those tokens, giving the same result where both apply:

* a template with `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
* any other template, prefix by prefix: for assistant message i, render `messages[:i]` with the
  generation prompt and `messages[:i+1]` without; the text the second adds is the assistant span.
  The *whole* conversation is rendered and tokenised once and a token is trained on when its first
  character lies in a span (the fast tokenizer's character offsets). Tokenising the full text
  once, instead of concatenating per-turn tokenisations, gives exactly the ids the model sees at
  inference: nothing drifts where turns meet.

Templates that rewrite history (e.g. drop earlier turns' reasoning) break the prefix property and
are refused with a message naming the turn; so is a template that silently ignores a row's tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ValueError):
    """A conversation the chat template cannot turn into a training example (one bad row)."""


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    """1 on tokens of assistant turns (what the loss covers), 0 elsewhere."""
    images: Any = None
    """The conversation's `ImageInputs` (polyrl/data/multimodal.py), its placeholders expanded
    in `input_ids`; None for a text-only one."""


def template_of(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    if not template:
        raise ValueError("the tokenizer has no chat template, so assistant turns cannot be found; "
                         "use a model with a chat_template (an instruct model) or add one to its "
                         "tokenizer_config.json / chat_template.jinja")
    return template


class ChatEncoder:
    """Encodes conversations for one tokenizer (`{% generation %}` path when the template has it)."""

    def __init__(self, tokenizer: Any, use_generation_tags: bool | None = None):
        self.tokenizer = tokenizer
        template = template_of(tokenizer)
        has_tags = bool(GENERATION_TAG.search(template))
        self.use_generation_tags = has_tags if use_generation_tags is None else use_generation_tags
        if self.use_generation_tags and not has_tags:
            raise ValueError("the chat template has no {% generation %} markers")
        if not self.use_generation_tags and not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: the assistant "
                             "mask needs character offsets (a tokenizer.json), or a chat template "
                             "with {% generation %} markers")

    def render(self, messages: list[dict], tools: list | None = None, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja raise_exception(...), missing keys: the row's problem
            raise TemplateError(f"the chat template fails on this conversation: "
                                f"{type(exc).__name__}: {exc}") from None

    def count_tokens(self, messages: list[dict], tools: list | None = None) -> int:
        """len(encode(messages, tools).input_ids) from one render and one tokenisation, without
        locating the assistant turns (which costs a render per turn): the length check of every
        row, and the probe of left truncation, stay linear in the conversation."""
        text = self.render(messages, tools)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: list[dict], tools: list | None = None) -> Encoded:
        if tools and self.render(messages, tools) == self.render(messages):
            raise TemplateError("the row has tools but the chat template does not render them "
                                "(the model would never see the tool schemas); drop the tools "
                                "column (data.tools_key) or use a model whose template supports tools")
        enc = self._by_generation_tags(messages, tools) if self.use_generation_tags \
            else self._by_prefixes(messages, tools)
        if not any(enc.loss_mask):
            raise TemplateError("the assistant turns render to no tokens")
        return enc

    def _by_generation_tags(self, messages: list[dict], tools: list | None) -> Encoded:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
        except Exception as exc:
            raise TemplateError(f"the chat template fails on this conversation: "
                                f"{type(exc).__name__}: {exc}") from None
        return Encoded(list(out["input_ids"]), [int(m) for m in out["assistant_masks"]])

    def assistant_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) character span of each assistant turn."""
        text = self.render(messages, tools)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._prompt_text(messages[:i], tools)
            through = self.render(messages[: i + 1], tools)
            if not through.startswith(before):
                raise TemplateError(
                    f"message {i}: the template renders the conversation up to this assistant "
                    "turn differently from its generation prompt, so the turn's tokens cannot be "
                    "located; use a template with {% generation %} markers")
            if not text.startswith(through):
                raise TemplateError(
                    f"message {i}: rendering later turns changes this turn's text (the template "
                    "rewrites history, e.g. drops earlier reasoning), so it is not what the model "
                    "sees when it answers; use a template with {% generation %} markers")
            if len(through) == len(before):
                raise TemplateError(f"message {i}: the assistant turn renders to no text")
            spans.append((len(before), len(through)))
        return text, spans

    def _prompt_text(self, history: list[dict], tools: list | None) -> str:
        if history:
            return self.render(history, tools, generation_prompt=True)
        try:  # a conversation opening with the assistant: some templates cannot render []
            return self.tokenizer.apply_chat_template([], tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - then nothing precedes the first turn
            return ""

    def _by_prefixes(self, messages: list[dict], tools: list | None) -> Encoded:
        text, spans = self.assistant_spans(messages, tools)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        boundaries = sorted({b for span in spans for b in span})
        b = 0  # boundaries and tokens are both in text order: one pass over each
        for start, end in offsets:  # a token across a turn boundary holds both kinds of text
            while b < len(boundaries) and boundaries[b] <= start:
                b += 1
            if b < len(boundaries) and boundaries[b] < end:
                cut = boundaries[b]
                raise TemplateError(
                    f"the tokenizer merges {text[start:end]!r} across the boundary of an assistant "
                    f"turn (character {cut}), so no token set is exactly the turn; use a template "
                    "that separates turns with special tokens, or {% generation %} markers")
        mask = [0] * len(ids)
        k = 0  # spans and tokens are both in text order: one merge-like pass
        for t, (start, _end) in enumerate(offsets):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                mask[t] = 1
        return Encoded(ids, mask)
