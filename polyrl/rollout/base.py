"""The contract every rollout engine implements (built-in, vLLM, SGLang, TensorRT-LLM).

An engine serves many concurrent `generate` calls; the n samples of one call share one prefill.
Every output carries the weight version that produced it, so a trainer always knows which policy
generated a sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, AsyncIterator, Iterable, Iterator, Literal, Mapping, Protocol, Sequence,
                    runtime_checkable)

import torch

from polyrl.backends import ROLLOUT_BACKENDS

if TYPE_CHECKING:
    from polyrl.data.multimodal import ImageInputs

StopReason = Literal["stop", "length", "aborted"]


class RolloutInputError(ValueError):
    """Bad request input. `field` names the offending field (HTTP 400 on the API)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # survive pickling across Ray / process boundaries
        return type(self), (self.field, self.message)


def per_prompt(count: int, sampling: "SamplingParams | Sequence[SamplingParams]",
               images: "Sequence[ImageInputs | None] | None") -> tuple[list, list]:
    """A `generate_batch` call's sampling params and images, one of each per prompt, for every
    engine alike: one SamplingParams stands for all; `images` None is all text, else one entry
    (ImageInputs or None) per prompt."""
    samplings = [sampling] * count if isinstance(sampling, SamplingParams) else list(sampling)
    if len(samplings) != count:
        raise ValueError(f"{len(samplings)} sampling params for {count} prompts")
    if hasattr(images, "pixel_values"):
        raise RolloutInputError("images", "takes one entry per prompt (a list of ImageInputs or None), "
                                "not one ImageInputs")
    per_image = [None] * count if images is None else list(images)
    if len(per_image) != count:
        raise RolloutInputError("images", f"{len(per_image)} entries for {count} prompts")
    return samplings, per_image


class WeightUpdateError(ValueError):
    """A rejected weight update; the engine keeps serving the previous weights."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    max_tokens: int = 64
    """Most tokens to generate per sample."""
    n: int = 1
    """Samples per prompt; they share one prefill."""
    stop_token_ids: Sequence[int] = ()
    """Generation of a sample ends after any of these tokens (it is kept in the output)."""
    stop: Sequence[str] = ()
    """Stop strings: generation ends once the decoded text contains one (text is cut before it)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    logprobs: bool = True
    """Return the log-prob of each sampled token."""
    top_logprobs: int = 0
    """Also return the top-k log-probs at each position (0 disables)."""
    ignore_eos: bool = False
    """Keep generating past the tokenizer's end-of-sequence token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the sample has generated so far (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the sample has generated it (OpenAI's)."""
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Token id -> value added to its logit before sampling (OpenAI's; -100 bans, 100 forces).
    Penalties and bias shape what is sampled; the returned log-probs stay those of the model's
    raw distribution, as for temperature and top-p."""

    def validate(self) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RolloutInputError("temperature", f"must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise RolloutInputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RolloutInputError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.n < 1:
            raise RolloutInputError("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise RolloutInputError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.top_logprobs < 0:
            raise RolloutInputError("top_logprobs", f"must be >= 0, got {self.top_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise RolloutInputError(name, f"must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias.items():
            if not (isinstance(token, int) and token >= 0):
                raise RolloutInputError("logit_bias", f"keys must be token ids, got {token!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise RolloutInputError("logit_bias", f"token {token}: bias must be in [-100, 100], got {bias}")
        return self


@dataclass
class TokenOutput:
    token_ids: list[int]
    """Generated tokens (the prompt excluded)."""
    logprobs: list[float]
    """Log-prob of each generated token under the sampling policy's *unmodified* distribution
    (temperature 1, no top-p / top-k), i.e. what a trainer forward of the same weights gives."""
    stop_reason: StopReason
    weight_version: int
    """Version of the weights that generated these tokens."""
    top_logprobs: list[dict[int, float]] | None = None
    text: str | None = None
    """Decoded text when the engine has a tokenizer (cut before a matched stop string)."""
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer, the workers and the server call on an engine (the built-in one in
    `native/engine.py`, the GPU adapters in `engines/`). Generation is async (`generate`) or a
    blocking batch (`generate_batch`, what rollout workers call); control calls are
    synchronous. Engines that can stream tokens also implement `StreamingRolloutEngine`.

    Image prompts (vision-language models, issue #31): the generation calls take `images=`, a
    keyword only, default None: a prompt's `ImageInputs` (polyrl/data/multimodal.py), its ids
    holding the processor's expanded image placeholders. Text-only callers never pass it, so an
    engine without image support keeps working for them; one that serves images accepts it on
    all three calls (the built-in engine: polyrl/rollout/native/vision.py).

    What an engine can do beyond this (tensor parallelism, freeing memory in `sleep`, log-probs
    in the trainer's numerics, partial rollout, ...) is declared, not probed: its backend's
    `EngineCapabilities` (polyrl/backends.py), which callers ask instead of the backend's name."""

    weight_version: int
    """The version of the weights being served (stamped on every output)."""
    tokenizer: Any
    """The Hugging Face tokenizer, or None when the engine was built without one (no stop
    strings, no text)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a sample (the model's and the tokenizer's end-of-sequence)."""
        ...

    @classmethod
    def from_model(cls, model: Any, *args: Any, tokenizer: Any = None, **kwargs: Any) -> "RolloutEngine":
        """Colocated placement: an engine in this process serving `model`'s current weights as
        version 0 (`polyrl/rollout/factory.py` passes the engine's own arguments)."""
        ...

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None,
        *, images: "ImageInputs | None" = None,
    ) -> list[TokenOutput]:
        """n = sampling.n outputs for one prompt."""
        ...

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str] | None = None, *, images: "Sequence[ImageInputs | None] | None" = None,
    ) -> list[list[TokenOutput]]:
        """Blocking: every prompt's n outputs, in prompt order. Every prompt is validated before
        any is queued, so a bad one rejects the whole call (RolloutInputError). `images`: one
        entry per prompt (None for a text-only one)."""
        ...

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Load Hugging Face-named tensors atomically (all or nothing), then serve `version`;
        a rejected update raises WeightUpdateError and the previous weights keep serving."""
        ...

    def sleep(self) -> None:
        """Free the KV cache (and other transient memory) while the trainer works."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep`; requests queued meanwhile run from here on."""
        ...

    def abort_all(self) -> int:
        """Abort every in-flight request; each returns its partial output with
        stop_reason="aborted". Returns how many were aborted."""
        ...

    def health(self) -> dict:
        """A JSON-able snapshot: at least weight_version, running requests and sleeping."""
        ...


@runtime_checkable
class StreamingRolloutEngine(RolloutEngine, Protocol):
    """An engine that streams each request's tokens as they are produced (the OpenAI server's
    `stream=true` uses it when present, else serves the finished request as one update)."""

    def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                        request_id: str | None = None, *, images: "ImageInputs | None" = None
                        ) -> AsyncIterator[Any]:
        """An async iterator of the request's updates; the last one holds what `generate`
        returns for the same request and seed."""
        ...


class _EngineClasses:
    """`ROLLOUT_BACKENDS` (`polyrl/backends.py`, the one list of backends) seen as
    name -> engine class, each imported when first asked for."""

    def get(self, name: str) -> type:
        return ROLLOUT_BACKENDS.get(name).engine_class()

    def names(self) -> list[str]:
        return ROLLOUT_BACKENDS.names()

    def __contains__(self, name: object) -> bool:
        return name in ROLLOUT_BACKENDS

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


ROLLOUT_ENGINES = _EngineClasses()
