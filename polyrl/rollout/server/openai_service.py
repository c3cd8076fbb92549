"""The OpenAI-compatible API's logic over one engine, independent of the web framework.

A request is tokenized here (chat messages through the tokenizer's own chat template), its
sampling fields become `SamplingParams`, and the engine does the rest. Input errors surface as
`RolloutInputError(field, ...)` with the field named as the *client* sent it ("prompt",
"messages"), which `app.py` turns into HTTP 400.

Streaming note: the engine's `generate` returns finished samples, so a stream is produced once a
request is complete, one SSE chunk per generated token. Clients see the standard chunk protocol;
true token-by-token latency needs an engine-side token stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any, Iterator, Sequence

from polyrl.rollout.base import RolloutInputError, SamplingParams, TokenOutput
from polyrl.rollout.server.openai_format import TokenText, envelope, finish_reason, usage
from polyrl.rollout.server.protocol import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_from_dict,
)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class OpenAIService:
    """Args:
        engine: any `RolloutEngine`; its `tokenizer` and `max_model_len` are used when present.
        model_name: the id clients put in "model" (the model's path is accepted too).
    """

    def __init__(self, engine: Any, model_name: str, *, aliases: Sequence[str] = ()):
        self.engine, self.model_name = engine, model_name
        self.accepted_names = {model_name, *aliases}
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.text = TokenText(self.tokenizer)
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "polyrl",
                "max_model_len": self.max_model_len}
        return {"object": "list", "data": [card]}

    def health(self) -> dict:
        return self.engine.health()

    # -- token level (the router's HTTP replicas) -----------------------------------------------

    async def generate_tokens(self, prompt_ids: list[int], sampling: dict | None,
                              request_id: str | None) -> dict:
        outs = await self.engine.generate(prompt_ids, sampling_from_dict(sampling),
                                          request_id or uuid.uuid4().hex)
        return {"outputs": [dataclasses.asdict(o) for o in outs]}

    # -- /v1/completions ------------------------------------------------------------------------

    async def complete(self, req: CompletionRequest) -> dict | Iterator[str]:
        self._check_model(req.model)
        if req.echo:
            raise RolloutInputError("echo", "is not supported by this server")
        prompts = [self._encode(p) for p in req.prompts()]
        max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        sampling = req.sampling(max_tokens, top_logprobs=req.logprobs or 0)
        rid = f"cmpl-{uuid.uuid4().hex}"
        results = await self._generate_all(prompts, sampling, rid, field="prompt")
        n_prompt = sum(len(p) for p in prompts)
        flat = [o for outs in results for o in outs]
        if req.stream:
            return self._completion_chunks(rid, flat, req, usage(n_prompt, flat))
        choices = []
        for index, out in enumerate(flat):
            pieces = self.text.pieces(out) if req.logprobs is not None else ()
            choices.append({
                "index": index, "text": self.text.text(out), "finish_reason": finish_reason(out),
                "logprobs": self.text.completion_logprobs(out, pieces) if req.logprobs is not None else None,
            })
        return envelope("text_completion", rid, self.model_name, choices, usage=usage(n_prompt, flat))

    def _completion_chunks(self, rid: str, outs: list[TokenOutput], req: CompletionRequest,
                           totals: dict) -> Iterator[str]:
        for index, out in enumerate(outs):
            pieces, offset = self.text.pieces(out), 0
            for k, piece in enumerate(pieces or [""]):
                last = k >= len(pieces) - 1
                logprobs = None
                if req.logprobs is not None and pieces:
                    logprobs = self.text.completion_logprobs(out, [piece], start=k, offset=offset)
                offset += len(piece)
                choice = {"index": index, "text": piece, "logprobs": logprobs,
                          "finish_reason": finish_reason(out) if last else None}
                yield sse(envelope("text_completion", rid, self.model_name, [choice]))
        if req.include_usage_in_stream:
            yield sse(envelope("text_completion", rid, self.model_name, [], usage=totals))
        yield sse("[DONE]")

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest) -> dict | Iterator[str]:
        self._check_model(req.model)
        prompt = self._render_chat(req)
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), None)
        if max_tokens is None:  # OpenAI's chat default: as long as the context allows
            max_tokens = max(1, (self.max_model_len or len(prompt) + 256) - len(prompt))
        top = (req.top_logprobs or 0) if req.logprobs else 0
        sampling = req.sampling(max_tokens, top_logprobs=top)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        (outs,) = await self._generate_all([prompt], sampling, rid, field="messages")
        totals = usage(len(prompt), outs)
        if req.stream:
            return self._chat_chunks(rid, outs, req, totals)
        choices = [{
            "index": i, "message": {"role": "assistant", "content": self.text.text(out)},
            "logprobs": self.text.chat_logprobs(out) if req.logprobs else None,
            "finish_reason": finish_reason(out),
        } for i, out in enumerate(outs)]
        return envelope("chat.completion", rid, self.model_name, choices, usage=totals)

    def _chat_chunks(self, rid: str, outs: list[TokenOutput], req: ChatCompletionRequest,
                     totals: dict) -> Iterator[str]:
        def chunk(choice: dict) -> str:
            return sse(envelope("chat.completion.chunk", rid, self.model_name, [choice]))

        for index, out in enumerate(outs):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
            pieces = self.text.pieces(out)
            for k, piece in enumerate(pieces):
                logprobs = self.text.chat_logprobs(out, k, k + 1) if req.logprobs else None
                yield chunk({"index": index, "delta": {"content": piece}, "logprobs": logprobs,
                             "finish_reason": None})
            yield chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(out)})
        if req.include_usage_in_stream:
            yield sse(envelope("chat.completion.chunk", rid, self.model_name, [], usage=totals))
        yield sse("[DONE]")

    # -- shared ---------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise RolloutInputError("model", f"unknown model '{name}'; this server serves '{self.model_name}'")

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise RolloutInputError("prompt", "text prompts need a tokenizer; this engine has none, send token ids")
        return self.tokenizer.encode(prompt)

    def _render_chat(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise RolloutInputError("messages", "is empty; send at least one message")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RolloutInputError("messages", "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in req.messages], add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template itself rejects the conversation (jinja raise)
            raise RolloutInputError("messages", f"the chat template rejected them: {exc}") from None
        # The template already wrote any BOS / special tokens as text.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _generate_all(self, prompts: list[list[int]], sampling: SamplingParams, rid: str,
                            field: str) -> list[list[TokenOutput]]:
        """All prompts concurrently; one failure cancels the rest (their slots free at once)."""
        tasks = [asyncio.ensure_future(self.engine.generate(p, sampling, f"{rid}-{i}"))
                 for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except RolloutInputError as exc:
            if exc.field == "prompt_ids":  # name the field the client sent
                raise RolloutInputError(field, str(exc).split(": ", 1)[-1]) from None
            raise
        finally:
            for task in tasks:
                task.cancel()
