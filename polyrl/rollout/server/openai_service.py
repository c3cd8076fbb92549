"""The OpenAI-compatible API's logic over one engine, independent of the web framework.

A request is tokenized here (chat messages through the tokenizer's own chat template), its
sampling fields become `SamplingParams`, and the engine does the rest. Input errors surface as
`RolloutInputError(field, ...)` with the field named as the *client* sent it ("prompt",
"messages"), which `app.py` turns into HTTP 400.

Chat messages with image content parts (a vision-language model) go through
`openai_images.py`: expanded ids plus the images, handed to the engine with `images=`.

With `stream=true` the engine's per-request token stream (`generate_stream`) is forwarded as SSE
chunks while the request runs (see `openai_stream.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, AsyncIterator, Sequence

from polyrl.rollout.base import RolloutInputError, SamplingParams, TokenOutput
from polyrl.rollout.server.openai_format import TokenText, envelope, finish_reason, usage
from polyrl.rollout.server.openai_images import ChatImages, LocalMedia, has_image_parts
from polyrl.rollout.server.openai_stream import FinishedStream, close_all, sse_events
from polyrl.rollout.server.protocol import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_from_dict,
)
from polyrl.rollout.server.trajectories import TrajectoryRecorder, TurnRequest

MAX_SEQUENCES_PER_REQUEST = 1024
"""Default cap on prompts x n of one request. The engine runs requests first come, first served,
so one request of 1000 prompts x n=100 would hold every slot for the whole of its 100000
samples while other clients wait; over the cap a request is refused (400) and the client splits
it. 1024 is four full batches of the default --max-num-seqs (256)."""


class OpenAIService:
    """Args:
        engine: any `RolloutEngine`; its `tokenizer` and `max_model_len` are used when present.
        model_name: the id clients put in "model" (the model's path is accepted too).
        local_media: the local image files clients may name (openai_images.py; default none).
    """

    def __init__(self, engine: Any, model_name: str, *, aliases: Sequence[str] = (),
                 recorder: TrajectoryRecorder | None = None,
                 max_sequences_per_request: int = MAX_SEQUENCES_PER_REQUEST,
                 local_media: LocalMedia | None = None):
        if max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {max_sequences_per_request}")
        self.engine, self.model_name, self.recorder = engine, model_name, recorder
        self.max_sequences_per_request = max_sequences_per_request
        # the logits' width (the native engine's model spec); None: the engine checks ids itself
        self.vocab_size: int | None = getattr(getattr(engine, "spec", None), "vocab_size", None)
        self.accepted_names = {model_name, *aliases}
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.text = TokenText(self.tokenizer)
        self.images = ChatImages(engine, self.tokenizer, local_media)
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
        params = sampling_from_dict(sampling)
        self._admit(1, params, field="n")
        outs = await self.engine.generate(prompt_ids, params, request_id or uuid.uuid4().hex)
        return {"outputs": [dataclasses.asdict(o) for o in outs]}

    # -- /v1/completions ------------------------------------------------------------------------

    async def complete(self, req: CompletionRequest, trajectory: str | None = None) -> dict | AsyncIterator[str]:
        """/v1/completions; with `trajectory`, one recorded turn of that black-box trajectory."""
        if trajectory is None:
            self._check_model(req.model)  # a trajectory is always the policy, whatever the agent names
        _refuse_unsupported(req)
        if req.echo:
            raise RolloutInputError("echo", "is not supported by this server")
        max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        if trajectory is not None:
            prompts, results, sampling = await self._trajectory_completion(trajectory, req)
        else:
            sampling = req.sampling(max_tokens, top_logprobs=req.logprobs or 0)
            self._admit(len(req.prompts()), sampling, field="prompt")  # before tokenizing them
            prompts = [self._encode(p) for p in req.prompts()]
        n_prompt = sum(len(p) for p in prompts)
        if req.stream:
            if trajectory is not None:
                streams = [FinishedStream(outs) for outs in results]
            else:
                streams = await self._open_streams(prompts, sampling, rid, field="prompt")

            def choice(index, delta, piece, reason):
                logprobs = None
                if req.logprobs is not None and delta.token_ids:
                    logprobs = self.text.completion_logprobs(
                        _partial(delta), [self.text.token(t) for t in delta.token_ids])
                if not piece and logprobs is None and reason is None:
                    return None
                return {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": reason}

            return sse_events(streams, n=sampling.n, text=self.text, stops=sampling.stop,
                              kind="text_completion", rid=rid, model=self.model_name, choice=choice,
                              prompt_tokens=n_prompt, include_usage=req.include_usage_in_stream)
        if trajectory is None:
            results = await self._generate_all(prompts, sampling, rid, field="prompt")
        flat = [o for outs in results for o in outs]
        choices = []
        for index, out in enumerate(flat):
            pieces = self.text.pieces(out) if req.logprobs is not None else ()
            choices.append({
                "index": index, "text": self.text.text(out), "finish_reason": finish_reason(out),
                "logprobs": self.text.completion_logprobs(out, pieces) if req.logprobs is not None else None,
                **(_ids(prompts[0], out) if trajectory is not None else {}),
            })
        return envelope("text_completion", rid, self.model_name, choices, usage=usage(n_prompt, flat))

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, trajectory: str | None = None) -> dict | AsyncIterator[str]:
        """/v1/chat/completions; with `trajectory`, one recorded turn of that black-box trajectory."""
        if trajectory is None:
            self._check_model(req.model)  # a trajectory is always the policy, whatever the agent names
        _refuse_unsupported(req)
        self._check_messages(req)
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), None)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.as_template_input() for m in req.messages]
        images = None
        if has_image_parts(messages) and trajectory is not None:
            raise RolloutInputError("messages", "image content parts in a recorded trajectory are not supported yet")
        if trajectory is not None:
            prompt, out, sampling = await self.recorder_or_fail().chat_turn(
                trajectory, self.engine, [m.as_template_input() for m in req.messages], self._render_messages,
                TurnRequest.of(req, max_tokens, top), text=self.text.text)
            outs = [out]
        else:
            if has_image_parts(messages):
                prompt, images = self.images.prompt(messages, self._template_text)
            else:
                prompt = self._render_messages(messages)
            if max_tokens is None:  # OpenAI's chat default: as long as the context allows
                max_tokens = max(1, (self.max_model_len or len(prompt) + 256) - len(prompt))
            sampling = req.sampling(max_tokens, top_logprobs=top)
            self._admit(1, sampling, field="n")
        if req.stream:
            if trajectory is not None:
                streams = [FinishedStream(outs)]
            else:
                streams = await self._open_streams([prompt], sampling, rid, field="messages", images=[images])

            def choice(index, delta, piece, reason):
                logprobs = self.text.chat_logprobs(_partial(delta)) if req.logprobs and delta.token_ids else None
                if not piece and logprobs is None and reason is None:
                    return None
                return {"index": index, "delta": {"content": piece} if piece or reason is None else {},
                        "logprobs": logprobs, "finish_reason": reason}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(sampling.n)]
            return sse_events(streams, n=sampling.n, text=self.text, stops=sampling.stop,
                              kind="chat.completion.chunk", rid=rid, model=self.model_name,
                              choice=choice, prompt_tokens=len(prompt),
                              include_usage=req.include_usage_in_stream, opening=opening)
        if trajectory is None:
            (outs,) = await self._generate_all([prompt], sampling, rid, field="messages", images=[images])
        choices = [{
            "index": i, "message": {"role": "assistant", "content": self.text.text(out)},
            "logprobs": self.text.chat_logprobs(out) if req.logprobs else None,
            "finish_reason": finish_reason(out),
            **(_ids(prompt, out) if trajectory is not None else {}),
        } for i, out in enumerate(outs)]
        return envelope("chat.completion", rid, self.model_name, choices, usage=usage(len(prompt), outs))

    # -- shared ---------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise RolloutInputError("model", f"unknown model '{name}'; this server serves '{self.model_name}'")

    def _admit(self, prompts: int, sampling: SamplingParams, field: str) -> None:
        """Refuse (400) what this server cannot run: more sequences than its per-request cap
        (`field` names what to shrink when n is 1), logit_bias ids the logits do not have."""
        total = prompts * sampling.n
        if total > self.max_sequences_per_request:
            raise RolloutInputError(
                "n" if sampling.n > 1 else field,
                f"{prompts} prompt(s) x n={sampling.n} = {total} sequences in one request; this "
                f"server takes at most {self.max_sequences_per_request} per request "
                "(polyrl serve --max-sequences-per-request); split it into smaller requests")
        if self.vocab_size is not None:
            bad = next((t for t in sampling.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise RolloutInputError("logit_bias", f"token id {bad} is outside the vocabulary "
                                                      f"[0, {self.vocab_size})")

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise RolloutInputError("prompt", "text prompts need a tokenizer; this engine has none, send token ids")
        return self.tokenizer.encode(prompt)

    def recorder_or_fail(self) -> TrajectoryRecorder:
        if self.recorder is None:
            raise RolloutInputError("trajectory", "this server records no trajectories (it serves black-box "
                                                  "agents only during a polyrl rollout)")
        return self.recorder

    async def _trajectory_completion(self, trajectory: str, req: CompletionRequest
                                     ) -> tuple[list[list[int]], list[list[TokenOutput]], SamplingParams]:
        prompts = req.prompts()
        if len(prompts) != 1:
            raise RolloutInputError("prompt", "a trajectory request carries one prompt (one path per trajectory)")
        ask = TurnRequest.of(req, req.max_tokens, req.logprobs or 0)  # None: the trainer's per-turn cap
        prompt, out, sampling = await self.recorder_or_fail().completion_turn(
            trajectory, self.engine, prompts[0], self._encode, ask, text=self.text.text)
        return [prompt], [[out]], sampling  # its stop strings cut a streamed reply too

    def _check_messages(self, req: ChatCompletionRequest) -> None:
        if not req.messages:
            raise RolloutInputError("messages", "is empty; send at least one message")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RolloutInputError("messages", "this model has no chat template; use /v1/completions")

    def _render_messages(self, messages: list[dict]) -> list[int]:
        # The template already wrote any BOS / special tokens as text.
        return self.tokenizer.encode(self._template_text(messages), add_special_tokens=False)

    def _template_text(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template itself rejects the conversation (jinja raise)
            raise RolloutInputError("messages", f"the chat template rejected them: {exc}") from None

    async def _open_streams(self, prompts: list[list[int]], sampling: SamplingParams, rid: str,
                            field: str, images: list[Any] | None = None) -> list[Any]:
        """One token stream per prompt, all queued before the response starts (input errors -> 400)."""
        if not hasattr(self.engine, "generate_stream"):
            results = await self._generate_all(prompts, sampling, rid, field, images)
            return [FinishedStream(outs) for outs in results]
        streams: list[Any] = []
        try:
            for i, p in enumerate(prompts):
                streams.append(self.engine.generate_stream(p, sampling, f"{rid}-{i}",
                                                           **_image_kwargs(images, i)))
        except RolloutInputError as exc:
            close_all(streams)
            raise _client_field(exc, field) from None
        except BaseException:
            close_all(streams)
            raise
        return streams

    async def _generate_all(self, prompts: list[list[int]], sampling: SamplingParams, rid: str,
                            field: str, images: list[Any] | None = None) -> list[list[TokenOutput]]:
        """All prompts concurrently; one failure cancels the rest (their slots free at once)."""
        tasks = [asyncio.ensure_future(self.engine.generate(p, sampling, f"{rid}-{i}", **_image_kwargs(images, i)))
                 for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except RolloutInputError as exc:
            raise _client_field(exc, field) from None
        finally:
            for task in tasks:
                task.cancel()


def _image_kwargs(images: list[Any] | None, i: int) -> dict:
    """`images=` for prompt i only where it has images: an engine without image support is never
    handed the keyword by a text request."""
    return {} if images is None or images[i] is None else {"images": images[i]}


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming an OpenAI field the engine cannot honour, instead of ignoring it."""
    found = req.unsupported()
    if found is not None:
        name, value = found
        raise RolloutInputError(name, f"{value!r} is not supported by this server (the native "
                                      "engine does not implement it); leave it unset")


def _client_field(exc: RolloutInputError, field: str) -> RolloutInputError:
    """The engine says "prompt_ids"; the client sent `field` ("prompt" / "messages")."""
    return RolloutInputError(field, exc.message) if exc.field == "prompt_ids" else exc


def _ids(prompt: list[int], out: TokenOutput) -> dict:
    """A trajectory turn's prompt and sampled ids in its choice (vLLM's field names), so an agent
    that keeps token ids itself can extend them exactly."""
    return {"prompt_token_ids": list(prompt), "token_ids": list(out.token_ids)}


def _partial(delta) -> TokenOutput:
    """A stream delta in TokenOutput's shape, for the log-prob formatters."""
    return TokenOutput(token_ids=delta.token_ids, logprobs=delta.logprobs, stop_reason="stop",
                       weight_version=0, top_logprobs=delta.top_logprobs)
