"""OpenAI request bodies, and their translation into engine inputs.

Pydantic here checks only types and shapes. Value ranges (temperature >= 0, top_p in (0, 1],
n >= 1, max_tokens >= 1) and prompt limits (empty, longer than max_model_len, unknown token ids)
are checked by the engine itself (`SamplingParams.validate`, the scheduler's `check`), so the HTTP
API, the Ray actor and the trainer cannot disagree about what a valid request is.

Unknown fields are refused by name (HTTP 400), as OpenAI does: a misspelt "temprature" must not
sample at the default. OpenAI fields this engine cannot honour (`UNSUPPORTED`) are accepted only
at their no-op value and refused by name otherwise, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field

from polyrl.rollout.base import RolloutInputError, SamplingParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions (chat defaults to "until max_model_len")."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's cap on /v1/completions `logprobs`."""
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's cap on /v1/chat/completions `top_logprobs`."""
UNSUPPORTED = {
    "best_of": 1, "suffix": "",
    "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
}
"""OpenAI fields the native engine cannot honour, each with the value that asks for nothing
(accepted, and null always is); any other value is a 400 naming the field."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"
    (some clients send explicit nulls)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Extension (vLLM-style): keep the k most likely tokens; -1 disables."""
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    """Extension: end a sample after any of these token ids."""
    ignore_eos: bool = False
    """Extension: keep generating past the end-of-sequence token."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, Any] | None:
        """The first field set to something this engine cannot do, with its value."""
        for name, no_op in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value != no_op:
                return name, value
        return None

    def sampling(self, max_tokens: int, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            n=1 if self.n is None else self.n,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(s for s in stop if s),
            seed=self.seed,
            logprobs=True,
            top_logprobs=top_logprobs,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._token_bias(),
        ).validate()

    def _token_bias(self) -> dict[int, float]:
        """OpenAI sends logit_bias keys as strings of token ids."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = float(value)
            except ValueError:
                raise RolloutInputError("logit_bias", f"keys must be token ids, got {key!r}") from None
        return out

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text, token ids, or a batch of either; each prompt gets n choices."""
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """Return the sampled tokens' log-probs plus this many top alternatives per position."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts as a list (a bare string or id list is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and (not p or isinstance(p[0], int))):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


_IMAGE_PARTS = ("image", "image_url")
"""Content-part types holding an image (polyrl/data/vision.py's IMAGE_PARTS)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """Plain-text content for the chat template (text parts of a multi-part message joined);
        a message with image parts keeps its parts (openai_images.py renders those)."""
        content = self.content
        if isinstance(content, list) and not any(part.get("type") in _IMAGE_PARTS for part in content):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    max_completion_tokens: int | None = None
    """Newer name of max_tokens; wins when both are given."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def sampling_from_dict(sampling: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """The token-level API's sampling argument: a SamplingParams or a dict of its fields.

    Unknown keys are refused by name rather than ignored, so a typo ("temprature") cannot
    silently sample with the default.
    """
    if isinstance(sampling, SamplingParams):
        return sampling.validate()
    sampling = dict(sampling or {})
    unknown = sorted(set(sampling) - _SAMPLING_FIELDS)
    if unknown:
        raise RolloutInputError(unknown[0], f"unknown sampling field; valid: {', '.join(sorted(_SAMPLING_FIELDS))}")
    try:
        return SamplingParams(**sampling).validate()
    except TypeError as exc:  # e.g. a string where a number belongs
        raise RolloutInputError("sampling", str(exc)) from None
