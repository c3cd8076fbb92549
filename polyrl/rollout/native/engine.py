"""NativeEngine: polyrl's built-in pure-PyTorch rollout engine (registered as "native").

It runs anywhere torch runs (the CPU default, or any device handed in), loads a local Hugging Face
decoder (or Qwen2-VL / Qwen2.5-VL vision-language) directory, and serves concurrent requests with continuous batching. Two front doors share
one `Scheduler`: `await generate(...)` for servers (an asyncio loop steps the scheduler in a worker
thread so the event loop stays responsive) and `generate_batch(...)` for a trainer thread or Ray
actor method (steps the scheduler to completion, no event loop needed). `generate_stream(...)` is
the token-by-token form of `generate`: an async iterator of each decode step's new tokens.

    engine = NativeEngine("/path/to/Qwen3-0.6B", dtype="bfloat16")
    outs = engine.generate_batch([[1, 2, 3]], SamplingParams(n=4, max_tokens=32))

A vision-language model takes each prompt's images as `images=` (an `ImageInputs` per prompt, or
None), the prompt ids holding the processor's expanded image placeholders (vision.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from polyrl.modeling import load_tokenizer, torch_dtype
from polyrl.rollout.base import SamplingParams, TokenOutput, WeightUpdateError, per_prompt
from polyrl.rollout.native.kv_cache import KVCache
from polyrl.rollout.native.loader import (
    eos_token_ids,
    load_config,
    read_state_dict,
    resolve_model_dir,
    spec_from_config,
)
from polyrl.rollout.native.invariant_model import InvariantDecoder
from polyrl.rollout.native.model import DecoderModel
from polyrl.rollout.native.scheduler import Request, Scheduler
from polyrl.rollout.native.streaming import StreamUpdate, TokenStream, post_to_loop
from polyrl.rollout.native.threads import FreeCoreThreads
from polyrl.rollout.native.weights import ModelWeights
from polyrl.weights.base import WeightStream

if TYPE_CHECKING:
    from polyrl.data.multimodal import ImageInputs

_resolve_dtype = torch_dtype  # the dtype names every layer shares (polyrl/modeling.py)


class NativeEngine:
    """Implements `polyrl.rollout.base.RolloutEngine`.

    Args:
        model_path: local HF directory (config.json, *.safetensors, tokenizer files).
        dtype: "float32" | "bfloat16" | "float16" (or a torch.dtype) for weights and KV cache
            (bf16 / fp16 on a CPU without their matrix instructions: products, attention and KV
            cache in fp32 over the same rounded values, see matmul.py).
        device: where weights, cache and compute live; the platform layer chooses it.
        max_model_len: prompt + generated tokens per sequence (default: the model's
            max_position_embeddings, capped at 4096). The KV cache grows lazily up to it.
        max_num_seqs: live sequences per decode step (n samples of a prompt count n each).
        max_prefill_tokens: padded prompt tokens admitted into one prefill batch.
        tokenizer: True loads it from model_path (needed for stop strings and `text`); False
            skips it; a tokenizer object is used as is.
        seed: seeds requests that carry no seed of their own.
        prefix_cache_tokens: keep the KV of finished sequences, up to this many tokens, so a prompt
            that extends one (a multi-turn trajectory's next turn) prefills only its new tokens;
            0 (default) keeps none. Cleared by a weight update or sleep().
        batch_invariant: compute with the batch-invariant forward the trainer also runs in
            `rollout.batch_invariant` mode (invariant_model.py): a token's log-prob is the same
            bits whatever the batch, padding or cache layout, and equals the trainer's. Slower
            (one thread, fixed matmul tiles; docs/benchmarks.md "Batch-invariant mode").
        num_threads: torch intra-op threads on a CPU. None (default) follows the cores that are
            free (threads.py: 1 when another busy process shares one of 2 cores), at most the
            count the process had when the engine was built; an int pins it (a run whose speed
            must not depend on the machine's load). The count applies to the thread that runs
            the engine's steps while they run; `generate_batch` restores the caller's after.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_prefill_tokens: int = 8192,
        tokenizer: bool | Any = True,
        seed: int = 0,
        prefix_cache_tokens: int = 0,
        batch_invariant: bool = False,
        num_threads: int | None = None,
    ):
        model_dir = resolve_model_dir(model_path)
        config = load_config(model_dir)
        spec_from_config(config)  # refuse unsupported architectures before reading weights
        if tokenizer is True:
            tokenizer = _load_tokenizer(model_dir)
        self._setup(config, read_state_dict(model_dir), tokenizer or None, model_dir,
                    dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_prefill_tokens=max_prefill_tokens, seed=seed, prefix_cache_tokens=prefix_cache_tokens,
                    batch_invariant=batch_invariant, num_threads=num_threads)

    @classmethod
    def from_model(
        cls,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        config: Any = None,
        *,
        tokenizer: Any = None,
        **kwargs,
    ) -> "NativeEngine":
        """Build from an in-memory HF model (e.g. the trainer's policy) or an HF-named state dict.

        Weights are copied into the engine's fused layout; later syncs go through update_weights.
        """
        if isinstance(model_or_state_dict, torch.nn.Module):
            config = config if config is not None else model_or_state_dict.config
            state = model_or_state_dict.state_dict()
        else:
            state = model_or_state_dict
        if config is None:
            raise ValueError("from_model: pass the model's HF config when giving a state dict")
        engine = cls.__new__(cls)
        engine._setup(config, state, tokenizer, None, **kwargs)
        return engine

    def _setup(self, config, state, tokenizer, model_dir, *, dtype="float32", device="cpu",
               max_model_len=None, max_num_seqs=256, max_prefill_tokens=8192, seed=0,
               prefix_cache_tokens=0, batch_invariant=False, num_threads=None) -> None:
        # the first window of the free-core sample spans the load below (threads.py)
        threads = FreeCoreThreads(num_threads) if torch.device(device).type == "cpu" else None
        self.spec = spec_from_config(config)
        if batch_invariant and self.spec.vision is not None:
            raise ValueError(f"native engine: batch_invariant=True is not supported for the vision-language "
                             f"{self.spec.architecture} yet; set rollout.batch_invariant=false")
        self.dtype, self.device = _resolve_dtype(dtype), torch.device(device)
        limit = self.spec.max_position_embeddings
        self.max_model_len = max_model_len or min(limit, 4096)
        if not 1 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [2, {limit}] "
                             f"(the model's max_position_embeddings)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        """The directory loaded (None when built from an in-memory model): the server reads a
        vision-language model's image processor there."""
        self.batch_invariant = bool(batch_invariant)
        self._weights = ModelWeights.from_state_dict(self.spec, state, self.dtype, self.device,
                                                     batch_hint=max_num_seqs, pack=not self.batch_invariant)
        if self.batch_invariant:  # the trainer's arithmetic: plain weights, cache in the model's dtype
            model = InvariantDecoder(self.spec, self._weights, dtype=self.dtype, device=self.device)
        else:
            model = DecoderModel(self.spec, self._weights, max_len=self.max_model_len, dtype=self.dtype,
                                 device=self.device)
        # bf16 / fp16 widened to fp32 on a CPU without their matrix instructions: attention too
        cache_dtype = torch.float32 if self._weights.matmul.widens else self.dtype
        cache = KVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim,
                        max_slots=max_num_seqs, max_len=self.max_model_len, dtype=cache_dtype, device=self.device)
        cache.prefix_budget = max(0, int(prefix_cache_tokens))
        self._sched = Scheduler(
            model, cache, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            max_prefill_tokens=max(max_prefill_tokens, self.max_model_len),
            eos_token_ids=eos_token_ids(model_dir, config, tokenizer), tokenizer=tokenizer, seed=seed,
        )
        self._lock = threading.Lock()  # one scheduler step / weight update / control op at a time
        self._control_pending = 0  # control ops waiting for the lock; steps let them in first
        self._pending_lock = threading.Lock()
        self._sleeping = False
        self._torn: str | None = None
        """Why the weights are incomplete (a streamed update broke off), or None."""
        self._loop_task: asyncio.Task | None = None
        # batch-invariant mode runs one thread whatever the load (invariant.py)
        self._threads = None if self.batch_invariant else threads
        if self._threads is not None:
            self._threads.start()

    # -- generation -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._sched.weight_version

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._sched.eos_token_ids

    @property
    def stats(self) -> dict:
        """Counters since start: prefill calls/tokens/seconds, decode steps/tokens/seconds."""
        return dict(self._sched.stats)

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None,
        *, images: ImageInputs | None = None,
    ) -> list[TokenOutput]:
        prompt = self._sched.check(prompt_ids, sampling)
        checked_images = self._sched.check_images(prompt, images)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        req = Request(request_id or uuid.uuid4().hex, prompt, sampling,
                      on_done=lambda r: post_to_loop(loop, _resolve, fut, r), images=checked_images)
        self._submit(req, loop)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def generate_stream(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None,
        *, images: ImageInputs | None = None,
    ) -> TokenStream:
        """Queue one prompt now and return an async iterator of its `StreamUpdate`s.

        Call from a coroutine (the updates are delivered to the running event loop). Input is
        validated here, so a bad request raises before anything is streamed. Each update holds
        the tokens (and log-probs) the samples gained since the previous one; the last update's
        `outputs` equal what `generate` returns for the same request and seed. Closing the
        stream early cancels the request (see `polyrl.rollout.native.streaming`).
        """
        prompt = self._sched.check(prompt_ids, sampling)
        checked_images = self._sched.check_images(prompt, images)
        loop = asyncio.get_running_loop()
        req = Request(request_id or uuid.uuid4().hex, prompt, sampling, images=checked_images)
        stream = TokenStream(req.request_id, loop, cancel=lambda: self._cancel(req))
        req.on_step = stream.push
        req.on_done = lambda r: stream.fail(r.error) if r.error is not None else stream.push(
            StreamUpdate([], r.outputs))
        self._submit(req, loop)
        return stream

    def _check_whole(self) -> None:
        if self._torn is not None:
            raise WeightUpdateError(f"native engine: {self._torn}; it serves nothing until a "
                                    "complete weight update")

    def _still_torn(self, torn: str | None, names: Iterable[str]) -> str | None:
        """After a torn update, only one that writes every weight makes the engine whole."""
        return torn if torn is not None and not self._weights.covers(names) else None

    def _submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> None:
        self._check_whole()
        with self._lock:
            self._sched.add(req)
        if self._loop_task is None or self._loop_task.done() or self._loop_task.get_loop() is not loop:
            self._loop_task = loop.create_task(self._serve())

    def _cancel(self, req: Request) -> None:
        with self._lock:
            if not req.done:
                self._sched.cancel(req)

    async def _serve(self) -> None:
        """Step while there is work; steps run in a worker thread so new requests can arrive."""
        while self._sched.has_work():
            if self._sleeping:
                await asyncio.sleep(0.01)
                continue
            await asyncio.to_thread(self._step)

    @contextmanager
    def _control(self):
        """The engine lock for a control op (abort, weight update, sleep, wake-up). A Lock is not
        fair: a thread stepping in a loop re-takes it at once and would starve an abort or a
        weight update until its generation ends, so scheduler steps wait while one is pending."""
        with self._pending_lock:
            self._control_pending += 1
        try:
            with self._lock:
                yield
        finally:
            with self._pending_lock:
                self._control_pending -= 1

    def _step(self) -> None:
        while self._control_pending:
            time.sleep(0.0002)
        with self._lock:
            if self._threads is not None:
                self._threads.refresh()
                self._threads.apply()  # this thread's count (an async step's worker thread keeps it)
            finished = [] if self._sleeping else self._sched.step()
        for req in finished:
            _notify(req)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str] | None = None,
        *,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[TokenOutput]]:
        """Synchronous: run the scheduler until every prompt's n samples are done.

        Every prompt is validated before any is queued, so a bad one rejects the whole call.
        `images`: one entry per prompt (None for a text-only one), or None for all text.
        """
        samplings, per_image = per_prompt(len(prompts), sampling, images)
        checked = [self._sched.check(p, s) for p, s in zip(prompts, samplings)]
        checked_images = [self._sched.check_images(p, i) for p, i in zip(checked, per_image)]
        ids = list(request_ids) if request_ids is not None else [uuid.uuid4().hex for _ in prompts]
        reqs = [Request(i, p, s, images=m) for i, p, s, m in zip(ids, checked, samplings, checked_images)]
        self._check_whole()
        with self._lock:
            if self._sleeping:
                raise RuntimeError("engine is sleeping; call wake_up() before generate_batch()")
            for req in reqs:
                self._sched.add(req)
        callers_threads = torch.get_num_threads()
        try:
            while not all(r.done for r in reqs):
                if self._sleeping:
                    raise RuntimeError("engine was put to sleep during generate_batch()")
                self._step()
        finally:
            if torch.get_num_threads() != callers_threads:  # the trainer's own count, back
                torch.set_num_threads(callers_threads)
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.outputs for r in reqs]

    # -- control --------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """All or nothing: every name and shape is checked before the first byte is written. A
        `WeightStream` (what a trainer syncs in place) is checked against its specs, then loaded
        one tensor at a time as it is produced; if it breaks after that, the engine refuses to
        generate until a complete update arrives (it never serves a mix of versions)."""
        if not isinstance(version, int):
            raise WeightUpdateError(f"version must be an int, got {type(version).__name__}")
        if isinstance(named_tensors, WeightStream):
            with self._control(), torch.inference_mode():
                dests = self._weights.plan_stream(named_tensors.specs)
                torn, self._torn = self._torn, f"the update to version {version} broke off midway"
                self._weights.load_stream(dests, named_tensors)
                self._sched.set_weight_version(version)
                self._torn = self._still_torn(torn, dests)
            return
        named = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        with self._control(), torch.inference_mode():
            plan = self._weights.validate(named)
            self._weights.apply(plan)
            self._torn = self._still_torn(self._torn, named)
            self._sched.set_weight_version(version)

    def sleep(self) -> None:
        """Free the KV cache. Queued async requests wait for wake_up()."""
        with self._control():
            if self._sched.running:
                raise RuntimeError(
                    f"cannot sleep with {len(self._sched.running)} running sequences; "
                    f"let them finish or call abort_all() first")
            self._sched.cache.release()
            self._sleeping = True

    def wake_up(self) -> None:
        with self._control(), torch.inference_mode():
            self._sched.cache.restore()
            self._sleeping = False

    def abort_all(self) -> int:
        with self._control(), torch.inference_mode():
            reqs = self._sched.abort_all()
        for req in reqs:
            _notify(req)
        return len(reqs)

    def health(self) -> dict:
        return {
            "ok": True,
            "weight_version": self.weight_version,
            "running": len(self._sched.running),
            "waiting": len(self._sched.waiting),
            "sleeping": self._sleeping,
            "kv_cache_bytes": self._sched.cache.nbytes,
            "matmul": type(self._weights.matmul).__name__,  # the CPU kernels in use (matmul.py)
            "packed_matrices": self._weights.compute.num_packed,
            # intra-op threads the steps run with, and the free cores they follow (threads.py)
            "threads": self._threads.count if self._threads is not None else torch.get_num_threads(),
            "free_cores": None if self._threads is None or self._threads.free is None
            else round(self._threads.free, 2),
        }


def _notify(req: Request) -> None:
    if req.on_done is not None:
        req.on_done(req)


def _resolve(fut: asyncio.Future, req: Request) -> None:
    if fut.done():
        return
    if req.error is not None:
        fut.set_exception(req.error)
    else:
        fut.set_result(req.outputs)


def _load_tokenizer(model_dir: Path):
    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"native engine: could not load a tokenizer from '{model_dir}' ({exc}); "
            f"pass tokenizer=False to run without one (no stop strings, no text)"
        ) from exc
