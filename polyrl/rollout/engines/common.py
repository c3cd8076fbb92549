"""What every GPU-engine adapter shares: one event loop that owns the engine, the sync and async
front doors on top of it, prompt checks, stop-reason mapping and the engine's tokenizer / EOS ids.

Why a loop thread: vLLM's `AsyncLLM`, SGLang's `Engine` and TRT-LLM's `AsyncLLM` all bind their
output handling to the asyncio loop they were first used on. The trainer calls the adapter from a
plain thread (`generate_batch`), servers from their own loop (`await generate`). Both hand their
coroutines to one loop that runs forever in a daemon thread and owns the engine, so neither
caller's loop ever touches engine state. Every wait on it has a deadline (R5).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch

from polyrl.rollout.base import (RolloutInputError, SamplingParams, StopReason, TokenOutput, WeightUpdateError,
                                 per_prompt)

T = TypeVar("T")

DEFAULT_CONTROL_TIMEOUT_S = 900.0
"""Deadline of a control call (weight update, sleep, wake-up, abort) on the engine's loop."""

ABORT_RESEND_S = 0.02
"""How often `abort_all` sends its abort again while a request it aborts is still running: an
engine can be handed a request id before it registers it (vLLM's `add_request` awaits input
processing first) and ignores an abort of an id it does not know yet."""

_STOP = {"stop": "stop", "eos": "stop", "stop_token": "stop", "stop_string": "stop",
         # vLLM >= 0.33 ends a sample caught in a loop with "repetition": the engine chose to end
         # it, the tokens so far are the sample (like a stop string).
         "repetition": "stop",
         "length": "length", "max_tokens": "length",
         "abort": "aborted", "aborted": "aborted", "cancelled": "aborted", "canceled": "aborted",
         "timeout": "aborted",
         # vLLM >= 0.33 finishes a request that failed inside the engine with "error": incomplete,
         # like an abort (partial rollouts resume it, a plain rollout keeps what it has).
         "error": "aborted"}


def map_stop_reason(raw: Any) -> StopReason:
    """An engine's finish reason as polyrl's stop / length / aborted.

    vLLM and TRT-LLM give a string (None for an unfinished output, which only an abort returns),
    SGLang a dict whose "type" is the string."""
    if isinstance(raw, dict):
        raw = raw.get("type")
    if raw is None:
        return "aborted"
    key = str(raw).lower()
    if key not in _STOP:
        raise ValueError(f"unknown engine finish reason {raw!r}; expected one of {sorted(_STOP)}")
    return _STOP[key]  # type: ignore[return-value]


def check_prompt(prompt_ids: Sequence[int]) -> list[int]:
    prompt = list(prompt_ids)
    if not prompt:
        raise RolloutInputError("prompt", "is empty; give at least one token id")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise RolloutInputError("prompt", "must be a list of non-negative integer token ids")
    return prompt


def sampled_logprobs(token_ids: Sequence[int], per_position: Sequence[Any] | None,
                     wanted: bool, pick) -> list[float]:
    """Log-prob of each *sampled* token. `per_position[i]` is the engine's record for position i
    and `pick(record, token_id)` reads the sampled token's log-prob out of it."""
    if not wanted:
        return []
    if per_position is None or len(per_position) != len(token_ids):
        raise RuntimeError(f"engine returned {0 if per_position is None else len(per_position)} "
                           f"log-prob records for {len(token_ids)} tokens")
    return [float(pick(rec, tok)) for rec, tok in zip(per_position, token_ids)]


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def update_stream(named_tensors: NamedTensors, version: Any, *, fp8: bool = False,
                  drain: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The start every adapter's `update_weights` shares: `version` must be an int (checked
    now, before anything is sent), the (name, tensor) pairs of a mapping or an iterable, each
    tensor detached and, with `fp8` (polyrl's block FP8 quantized on the sending side),
    quantized. Lazy (a weight stream is never held whole) unless `drain`: then the source is
    read to its end here, on the caller's thread, before the quantizer (the SGLang adapter's
    order: its pieces are consumed on the engine loop's thread)."""
    if not isinstance(version, int):
        raise WeightUpdateError(f"version must be an int, got {type(version).__name__}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    named: Iterable[tuple[str, torch.Tensor]] = (
        (n, t.detach() if isinstance(t, torch.Tensor) else t) for n, t in items)
    if drain:
        named = list(named)
    if fp8:
        from polyrl.weights.fp8 import quantize_named_tensors

        named = quantize_named_tensors(named)
    return iter(named)


@contextlib.contextmanager
def partial_update_guard(engine: str, version: int,
                         passthrough: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Turn a failure inside a piece-by-piece update into the one `WeightUpdateError` every
    adapter raises: the engine may hold a mix of versions now, and the message says so.
    `passthrough` exceptions (already naming the fix) go through unchanged."""
    try:
        yield
    except passthrough:
        raise
    except Exception as exc:
        raise WeightUpdateError(f"{engine} weight update to version {version} failed part-way "
                                f"({exc}); the engine's weights are inconsistent until the next "
                                "successful update") from exc


class EngineLoop:
    """An asyncio loop running forever in a daemon thread; the engine lives on it."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[T], timeout_s: float | None, what: str) -> T:
        """Run `coro` on the engine loop from any thread; raise TimeoutError naming `what`."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{what}: called from the engine loop itself (would deadlock)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s") from None

    async def run_async(self, coro: Awaitable[T]) -> T:
        """Await `coro` (run on the engine loop) from another running loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))  # type: ignore[arg-type]

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class AsyncEngineAdapter:
    """Base of the GPU adapters: subclasses implement `_start` (build the engine on the loop),
    `_generate_one` (n outputs for one prompt, on the loop) and the control methods."""

    backend = ""

    def _init_adapter(self, launch_args: dict[str, Any], model_key: str, tokenizer: Any, seed: int,
                      update_bucket_mb: int, control_timeout_s: float) -> None:
        """State every adapter shares; `model_key` names the model directory in `launch_args`."""
        self.launch_args = dict(launch_args)
        self.model_path = str(self.launch_args[model_key])
        self.bucket_bytes = update_bucket_mb << 20
        self._asleep: set[str] = set()  # the engine's memory tags released by sleep()
        self.seed = seed
        self.control_timeout_s = control_timeout_s
        self.tokenizer = _load_tokenizer(self.model_path) if tokenizer is True else (tokenizer or None)
        self._eos = _eos_token_ids(self.model_path, self.tokenizer)
        self._version = 0
        self._sleeping = False
        self._inflight: dict[str, asyncio.Task] = {}  # request id -> its task on the engine loop
        self._loop = EngineLoop(f"polyrl-{self.backend}-engine")

    @classmethod
    def from_model(cls, model: Any, *, launch_args: dict[str, Any], tokenizer: Any = True, **kwargs):
        """Colocated placement: start on dummy weights, then copy the trainer's weights in (v0)."""
        import torch

        engine = cls(launch_args, tokenizer=tokenizer, **kwargs)
        with torch.no_grad():
            engine.update_weights(model.named_parameters(), 0)
        return engine

    # --- generation ------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str | None = None, *, images: Any = None) -> list[TokenOutput]:
        prompt = check_prompt(prompt_ids)
        sampling.validate()
        checked = self._check_images(prompt, images)
        return await self._loop.run_async(self._tracked(prompt, sampling, request_id or uuid.uuid4().hex, checked))

    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       sampling: SamplingParams | Sequence[SamplingParams],
                       request_ids: Sequence[str] | None = None, *,
                       images: Sequence[Any] | None = None) -> list[list[TokenOutput]]:
        """Synchronous; every prompt is checked before any is sent, so a bad one rejects all.
        `images`: one `ImageInputs` (or None) per prompt, or None for all text."""
        samplings, per_image = per_prompt(len(prompts), sampling, images)
        checked = [check_prompt(p) for p in prompts]
        checked_images = [self._check_images(p, i) for p, i in zip(checked, per_image)]
        for s in samplings:
            s.validate()
        if self._sleeping:
            raise RuntimeError("engine is sleeping; call wake_up() before generate_batch()")
        ids = list(request_ids) if request_ids is not None else [uuid.uuid4().hex for _ in prompts]

        async def all_prompts():
            return await asyncio.gather(*(self._tracked(p, s, i, m) for p, s, i, m
                                          in zip(checked, samplings, ids, checked_images)))

        return list(self._loop.run(all_prompts(), None, f"{self.backend} generate_batch"))

    def _check_images(self, prompt: list[int], images: Any) -> Any:
        """A prompt's images as `_generate_one` takes them (None: text only), checked against its
        ids before anything is sent. Adapters that serve images override this."""
        if images is not None:
            raise RolloutInputError("images", f"rollout.backend={self.backend} does not take image prompts "
                                    "yet; use rollout.backend=native or vllm")
        return None

    async def _tracked(self, prompt: list[int], sampling: SamplingParams, request_id: str,
                       images: Any = None) -> list[TokenOutput]:
        task = asyncio.current_task()
        assert task is not None  # always run as a task on the engine loop
        self._inflight[request_id] = task
        try:
            # text-only calls keep the three-argument form every adapter implements
            extra = {} if images is None else {"images": images}
            outs = await self._generate_one(prompt, sampling, request_id, **extra)
        finally:
            if self._inflight.get(request_id) is task:
                del self._inflight[request_id]
        for out in outs:
            out.prompt_tokens = len(prompt)
        return outs

    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            request_id: str) -> list[TokenOutput]:
        raise NotImplementedError

    def _output(self, token_ids: Sequence[int], logprobs: list[float], reason: Any,
                text: str | None = None, top: list[dict[int, float]] | None = None) -> TokenOutput:
        """One output, stamped with the version being served."""
        return TokenOutput(token_ids=list(token_ids), logprobs=logprobs,
                           stop_reason=map_stop_reason(reason), weight_version=self._version,
                           top_logprobs=top, text=text)

    # --- control helpers -------------------------------------------------------------------------
    def _abort_until_ended(self, send_abort: Callable[[list[str]], Awaitable[Any]]) -> int:
        """Abort every request in flight now and return (how many) once each has ended.

        `send_abort(ids)` asks the engine to abort those ids. It is sent again every
        `ABORT_RESEND_S` to the ids still running: a request can be tracked here before the
        engine has registered its id, and the engine ignores the abort of an id it does not know,
        so one abort would miss it and it would run to its end. Requests started after this
        call are not touched. The whole wait has the control deadline."""

        async def abort() -> int:
            targets = dict(self._inflight)  # read on the loop: the only thread that changes it
            running = set(targets.values())
            while running:
                await send_abort(sorted(i for i, t in targets.items() if t in running))
                _, running = await asyncio.wait(running, timeout=ABORT_RESEND_S)
            return len(targets)

        return self._control(abort(), "abort")

    def _control(self, coro: Awaitable[T], what: str) -> T:
        return self._loop.run(coro, self.control_timeout_s, f"{self.backend} {what}")

    def health(self) -> dict:
        return {"ok": True, "backend": self.backend, "weight_version": self._version,
                "running": len(self._inflight), "sleeping": self._sleeping}

    def shutdown(self) -> None:
        self._loop.close()


def _load_tokenizer(model_path: str):
    from polyrl.modeling import load_tokenizer

    try:
        return load_tokenizer(model_path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from '{model_path}' ({exc}); pass "
                         "tokenizer=False to run without one") from exc


def _eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    from polyrl.rollout.native.loader import eos_token_ids, load_config

    model_dir = Path(model_path)
    config = load_config(model_dir) if (model_dir / "config.json").exists() else None
    return frozenset(eos_token_ids(model_dir if model_dir.is_dir() else None, config, tokenizer))
