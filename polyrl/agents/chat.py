"""The token ids a trajectory gains between two assistant turns, as the chat template renders them.

Token exactness rests on one rule: a trajectory's ids only ever grow by appending. The model's
sampled ids are appended as sampled (never decoded and re-encoded), and the ids of a tool or
environment turn are appended as the *difference* the chat template renders:

    T0 = template([user, assistant(S)])                          S: a sentinel content
    T1 = template([user, assistant(S), tool, ...], add_generation_prompt=True)
    delta = (what T0 renders after S, minus the stop token the model already sampled) + T1[len(T0):]

so the closing of the assistant turn ("<|im_end|>\n" in ChatML, the EOS in a bare template), the
tool / user header, its content and the next assistant header are exactly what the template would
have rendered for the whole conversation. The base conversation is a fixed two-message stub rather
than the real history, so rendering cost does not grow with the turn count (the approach verl's
agent loop takes, see docs/agents.md).

The delta text is tokenized after an anchor - a special token that always stands alone - and the
anchor's ids are cut off: a tokenizer that marks the start of a text (a SentencePiece-style
Metaspace "▁" prefix, a BOS) would otherwise tokenize the delta as if it began a document, while
in the trajectory it follows the model's stop token.
"""

from __future__ import annotations

from typing import Any, Sequence

SENTINEL = "POLYRL_ASSISTANT_TURN_SENTINEL"
_BASE = [{"role": "user", "content": "POLYRL_USER_SENTINEL"}, {"role": "assistant", "content": SENTINEL}]


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn (it re-renders earlier turns)."""


class ChatDelta:
    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("multi-turn rollouts need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._max_token_chars: int | None = None
        self._anchor, self._anchor_ids = _anchor(tokenizer)
        self._base = self._render(_BASE)
        at = self._base.rfind(SENTINEL)
        if at < 0:
            raise TemplateError("the chat template drops assistant content; cannot find where a turn ends")
        self._closing = self._base[at + len(SENTINEL):]
        """What the template renders after an assistant message's content (e.g. "<|im_end|>\\n")."""

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt (tools rendered into it), tokenized without extra special tokens like
        the dataset's chat prompts (polyrl/data/dataset.py)."""
        text = self._render(messages, generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def closing_rest(self, last_token: int | None) -> str:
        """The template's closing of an assistant turn, minus the stop token the model sampled."""
        if last_token is not None:
            sampled = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if sampled and self._closing.startswith(sampled):
                return self._closing[len(sampled):]
        return self._closing

    def delta_text(self, messages: list[dict], last_token: int | None) -> str:
        base = self._base
        full = self._render(_BASE + list(messages), generation_prompt=True)
        if not full.startswith(base):
            raise TemplateError("the chat template renders earlier turns differently once a "
                                f"{messages[0].get('role')!r} message follows; it cannot be extended "
                                "turn by turn")
        return self.closing_rest(last_token) + full[len(base):]

    def delta_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        """Ids to append after an assistant turn whose last sampled token is `last_token` (None
        when the turn did not end on a stop token: then the whole closing is appended)."""
        return self.encode_continuation(self.delta_text(messages, last_token))

    def delta_ids_within(self, messages: list[dict], last_token: int | None, budget: int) -> list[int]:
        """`delta_ids`, except that a delta longer than `budget` tokens may come back as a shorter
        prefix of it that is still longer than `budget`: a 5 MB tool result is not tokenized in
        full only to be refused (the caller ends the trajectory on any delta over its budget).

        A message content longer than (budget + 1) x the most characters one token stands for is
        cut to one character more before rendering: its tokens alone then pass the budget. Where
        that bound does not hold (a template that trims content, a tokenizer whose unknown-token
        or normalizer folds long text into few tokens) and the cut delta fits after all, the whole
        messages are tokenized: the shortcut never changes what is appended."""
        cut = max(budget + 1, 0)
        if not any(isinstance(m.get("content"), str) and len(m["content"]) > cut for m in messages):
            return self.delta_ids(messages, last_token)
        cut *= self.max_token_chars
        clipped = [{**m, "content": m["content"][:cut + 1]}
                   if isinstance(m.get("content"), str) and len(m["content"]) > cut else m for m in messages]
        if all(a is b for a, b in zip(clipped, messages)):
            return self.delta_ids(messages, last_token)
        ids = self.delta_ids(clipped, last_token)
        return ids if len(ids) > budget else self.delta_ids(messages, last_token)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to, bounded by its longest vocabulary entry (a
        byte-level entry has one character per byte, a SentencePiece entry one per character, a
        byte-fallback "<0x41>" more than its one byte)."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        return self._max_token_chars

    def encode_continuation(self, text: str) -> list[int]:
        """`text` tokenized as a continuation of a sequence, not as the start of a document."""
        if not text:
            return []
        if self._anchor is None:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = list(self.tokenizer(self._anchor + text, add_special_tokens=False)["input_ids"])
        n = len(self._anchor_ids)
        if ids[:n] != self._anchor_ids:  # the anchor merged with the text: fall back to plain
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids[n:]


def _anchor(tokenizer: Any) -> tuple[str | None, list[int]]:
    """A special token that tokenizes to itself alone (split off before any pre-tokenizer)."""
    candidates = [tokenizer.eos_token, getattr(tokenizer, "pad_token", None),
                  *getattr(tokenizer, "all_special_tokens", [])]
    for token in candidates:
        if not token:
            continue
        ids = list(tokenizer(token, add_special_tokens=False)["input_ids"])
        if len(ids) == 1 and ids[0] == tokenizer.convert_tokens_to_ids(token):
            return token, ids
    return None, []
