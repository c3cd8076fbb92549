"""Engine outputs (`TokenOutput`) in the shapes OpenAI clients parse.

Kept apart from the request handling so the response layout — which clients depend on field by
field — can be read and checked in one place.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from polyrl.rollout.base import TokenOutput

FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}
"""Engine stop_reason -> OpenAI finish_reason ("abort", as vLLM says, for aborted requests)."""


def finish_reason(out: TokenOutput) -> str:
    return FINISH_REASONS.get(out.stop_reason, out.stop_reason)


def usage(prompt_tokens: int, outputs: Sequence[TokenOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra: Any) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, **extra}


class IncrementalDecoder:
    """`tokenizer.decode(tokens, skip_special_tokens=True)` of a growing token list, decoding only
    the newest tokens plus a few tokens of context at each step: a bounded number of token ids
    per step, where decoding the whole list every step costs O(n) per token (O(n^2) a sample).

    The new text is the decode of the window (context + new tokens) minus the decode of the
    context alone, so a decoder that drops a leading space at the start of a decode
    (SentencePiece) gives what a full decode gives. The context is `CONTEXT` tokens, reaching
    further back while it decodes to nothing but whitespace (skipped special tokens, a lone
    space piece). Where the window's text does not start with the context's — a decoder that
    rewrote text across the boundary (`clean_up_tokenization_spaces`: " ." -> ".", " n't" ->
    "n't"), or a multi-byte character completed by the new tokens — the whole list is decoded
    once. The window moves on when its text ends on a complete character (an incomplete UTF-8
    sequence decodes to U+FFFD), or after `MAX_PENDING` tokens that still do not.
    """

    CONTEXT = 4
    MAX_CONTEXT = 16  # how far back the context may reach over whitespace-only decodes
    MAX_PENDING = 16

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._text = ""  # decode(tokens[:_read])
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; returns the decode of every token so far (it ends in U+FFFD while a
        multi-byte character is incomplete)."""
        self.tokens += token_ids
        start = max(self._read - self.CONTEXT, 0)
        context = self._decode(self.tokens[start:self._read])
        while start > max(self._read - self.MAX_CONTEXT, 0) and (not context or context.isspace()):
            start -= 1
            context = self._decode(self.tokens[start:self._read])
        window = self._decode(self.tokens[start:])
        if window.startswith(context) and (context or start == 0):
            text = self._text + window[len(context):]
        else:
            text = self._decode(self.tokens)
        if not text.endswith("\ufffd") or len(self.tokens) - self._read > self.MAX_PENDING:
            self._text, self._read = text, len(self.tokens)
        return text


class TokenText:
    """Token ids -> text pieces, with the tokenizer the engine uses (or none)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id])

    def text(self, out: TokenOutput) -> str:
        if out.text is not None:
            return out.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    def pieces(self, out: TokenOutput) -> list[str]:
        """One text delta per generated token; they join to exactly `text(out)`.

        Each delta is the growth of the decoded prefix, so multi-token characters appear once
        complete; clipping to the final text drops what a stop string cut off.
        """
        final = self.text(out)
        if self.tokenizer is None:
            return [""] * len(out.token_ids)
        pieces, emitted = [], 0
        decoder = IncrementalDecoder(self.tokenizer)
        for i, token in enumerate(out.token_ids, 1):
            prefix = decoder.add([token])  # decode(token_ids[:i])
            end = len(final) if i == len(out.token_ids) else min(len(prefix), len(final))
            if prefix.endswith("\ufffd") and i < len(out.token_ids):
                end = emitted  # an incomplete UTF-8 sequence: wait for its next byte
            pieces.append(final[emitted:max(end, emitted)])
            emitted = max(end, emitted)
        return pieces

    # -- log-probs ------------------------------------------------------------------------------

    def completion_logprobs(self, out: TokenOutput, pieces: Sequence[str], start: int = 0,
                            offset: int = 0) -> dict:
        """Legacy /v1/completions layout, for tokens [start, start + len(pieces))."""
        tokens, offsets, tops = [], [], []
        for i, piece in enumerate(pieces, start):
            tokens.append(self.token(out.token_ids[i]))
            offsets.append(offset)
            offset += len(piece)
            if out.top_logprobs is not None:
                tops.append({self.token(t): lp for t, lp in out.top_logprobs[i].items()})
        return {"tokens": tokens,
                "token_logprobs": list(out.logprobs[start:start + len(pieces)]),
                "top_logprobs": tops or None,
                "text_offset": offsets}

    def chat_logprobs(self, out: TokenOutput, start: int = 0, stop: int | None = None) -> dict:
        """/v1/chat/completions layout: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        content = []
        for i in range(start, len(out.token_ids) if stop is None else stop):
            tops = out.top_logprobs[i] if out.top_logprobs is not None else {}
            content.append({**self._entry(out.token_ids[i], out.logprobs[i]),
                            "top_logprobs": [self._entry(t, lp) for t, lp in tops.items()]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
