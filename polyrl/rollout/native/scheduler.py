"""The continuous-batching core shared by the async and the synchronous engine APIs.

`step()` is one scheduler iteration: admit waiting requests that fit (one prefill per prompt, its
KV copied to the n sample slots), then one decode step over *every* live sequence, then retire
finished sequences. Requests join and leave between steps. `step()` holds no lock and never
raises: a failure fails the affected requests and the engine keeps serving. A request with an
`on_step` hook (a token stream) is handed each step's new tokens as a `StreamUpdate`.

A request with images (a vision-language model, vision.py) carries its `PromptImages`: its
prefill runs the vision tower on them (one tower call for every image of the step's prefill) and
rotates by M-RoPE ids, its decode by cache index + rope delta, and its prefix-cache entries are
keyed by the images' digests too. Text-only requests take the plain paths.
"""

from __future__ import annotations

import operator
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

import torch

from polyrl.rollout.base import RolloutInputError, SamplingParams, TokenOutput
from polyrl.rollout.native.extend import extend
from polyrl.rollout.native.kv_cache import KVCache
from polyrl.rollout.native.model import DecoderModel, MultimodalInputs
from polyrl.rollout.native.moe import routed_experts
from polyrl.rollout.native.sampling import RowParams, sample
from polyrl.rollout.native.streaming import SampleDelta, StreamUpdate
from polyrl.rollout.native.vision import PromptImages, check_images


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    on_done: Callable[["Request"], None] | None = None
    on_step: Callable[[StreamUpdate], None] | None = None
    """Called from the stepping thread with the tokens each step added (streaming requests)."""
    images: PromptImages | None = None
    """The prompt's images (vision-language models; `Scheduler.check_images`), else None."""
    seqs: list["Sequence"] = field(default_factory=list)
    prompt_route: torch.Tensor | None = None
    """Mixture-of-experts: the expert ids [moe layers, k] of the prompt's last token at prefill."""
    outputs: list[TokenOutput] | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.outputs is not None or self.error is not None


@dataclass(eq=False)
class Sequence:
    """One of a request's n samples. Its last token is not yet in the KV cache (decode's input)."""

    request: Request
    row: RowParams
    index: int = 0
    """Which of the request's n samples this is."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    """Mixture-of-experts: expert ids [moe layers, k] of each generated token fed back (moe.py)."""
    stop_reason: str | None = None
    text: str | None = None
    min_version: int = 0
    max_version: int = 0

    @property
    def length(self) -> int:
        return len(self.request.prompt) + len(self.tokens)


class Scheduler:
    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_prefill_tokens: int,
        eos_token_ids: frozenset[int],
        tokenizer: Any,
        seed: int,
    ):
        self.model, self.cache = model, cache
        self.vision = model.spec.vision
        """The model's vision-language spec (vision.py), None for a text-only model."""
        self.invariant = getattr(model, "invariant", False)
        """The model returns log-probs (invariant_model.py), reported as they are."""
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids, self.tokenizer = eos_token_ids, tokenizer
        self._rng = random.Random(seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []  # running[i] lives in cache slot i
        self.weight_version = 0
        self.stats = dict(prefill_calls=0, prefill_tokens=0, prefill_s=0.0, prefix_reused_tokens=0,
                          decode_steps=0, decode_tokens=0, decode_s=0.0)

    # -- requests -------------------------------------------------------------------------------

    def check(self, prompt_ids: Seq[int], sampling: SamplingParams) -> list[int]:
        """Validate a request up front so a bad one never reaches (and breaks) a batch."""
        if not isinstance(sampling, SamplingParams):
            raise RolloutInputError("sampling", f"expected SamplingParams, got {type(sampling).__name__}")
        sampling.validate()
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        try:
            prompt = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise RolloutInputError("prompt_ids", "must be a sequence of integer token ids") from None
        if not prompt:
            raise RolloutInputError("prompt_ids", "is empty; at least one token is needed")
        if len(prompt) >= self.max_model_len:
            raise RolloutInputError(
                "prompt_ids", f"has {len(prompt)} tokens, the engine's max_model_len is "
                f"{self.max_model_len} (the prompt plus at least one generated token must fit)")
        vocab = self.model.spec.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RolloutInputError("prompt_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad_bias = next((t for t in (sampling.logit_bias or {}) if not 0 <= int(t) < vocab), None)
        if bad_bias is not None:  # the server checks this too; the Ray and trainer paths meet it here
            raise RolloutInputError("logit_bias", f"token id {bad_bias} is outside the vocabulary [0, {vocab})")
        if sampling.n > self.max_num_seqs:
            raise RolloutInputError("n", f"{sampling.n} exceeds the engine's max_num_seqs={self.max_num_seqs}")
        if sampling.stop and self.tokenizer is None:
            raise RolloutInputError("stop", "stop strings need an engine with a tokenizer")
        return prompt

    def check_images(self, prompt: list[int], images: Any) -> PromptImages | None:
        """Validate a prompt's images (`ImageInputs` or None) against its checked ids."""
        if images is None and self.vision is None:
            return None  # a text-only model's text prompt: nothing to look at
        return check_images(images, prompt, self.vision, digests=self.cache.prefix_budget > 0)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _new_sequence(self, req: Request, index: int) -> Sequence:
        sp = req.sampling
        # A seeded request's sample i always gets the same stream, whatever else is running.
        rng = random.Random(f"{sp.seed}/{index}") if sp.seed is not None else random.Random(self._rng.getrandbits(64))
        row = RowParams(sp.temperature, sp.top_p, sp.top_k, sp.top_logprobs, rng,
                        sp.presence_penalty, sp.frequency_penalty, dict(sp.logit_bias))
        v = self.weight_version
        return Sequence(req, row, index, min_version=v, max_version=v)

    # -- one iteration --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit + prefill, decode every live sequence once, retire. Returns completed requests."""
        completed: list[Request] = []
        admitted: list[Request] = []
        try:
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
                completed += self._retire()
            if self.running:
                self._decode()
                completed += self._retire()
        except Exception as exc:  # fail what was in flight, keep serving the queue
            failed = {s.request for s in self.running} | set(admitted)
            self.running = []
            for req in failed:
                if not req.done:
                    req.error = exc
                    completed.append(req)
        return completed

    def _admit(self) -> list[Request]:
        admitted, slots, longest = [], len(self.running), 0
        while self.waiting:
            req = self.waiting[0]
            longest_if = max(longest, len(req.prompt))
            if slots + req.sampling.n > self.max_num_seqs:
                break
            if admitted and longest_if * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            slots += req.sampling.n
            longest = longest_if
        return admitted

    def _prefill(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        device = self.model.device
        T = max(len(r.prompt) for r in reqs)
        base = len(self.running)
        firsts, new = [], []
        for r in reqs:
            r.seqs = [self._new_sequence(r, i) for i in range(r.sampling.n)]
            firsts.append(base + len(new))
            new += r.seqs
        self.cache.reserve(base + len(new), T)
        # A prompt that extends a stashed sequence (the next turn of a trajectory) computes only
        # its new tokens; the rest are prefilled together as usual.
        reused = [self.cache.take_prefix(r.prompt, first, r.images.keys if r.images else ())
                  for r, first in zip(reqs, firsts)]
        features = self._image_features(reqs, reused)
        logits: list[torch.Tensor | None] = [None] * len(reqs)
        for j, (r, first, start) in enumerate(zip(reqs, firsts, reused)):
            if start:
                mm = None if r.images is None else _multimodal(
                    r.images.positions[:, None, start:].to(device), [features[j]] if features[j] else [])
                logits[j] = (self.model.extend(r.prompt[start:], start, first, self.cache) if self.invariant
                             else extend(self.model, r.prompt[start:], start, first, self.cache, mm))
                r.prompt_route = None if self.invariant else _first_route(self.model)
        full = [j for j, start in enumerate(reused) if not start]
        if full:
            T = max(len(reqs[j].prompt) for j in full)
            tokens = torch.zeros(len(full), T, dtype=torch.long)
            for i, j in enumerate(full):
                tokens[i, : len(reqs[j].prompt)] = torch.tensor(reqs[j].prompt)
            lengths = torch.tensor([len(reqs[j].prompt) for j in full])
            mm = self._prefill_inputs([reqs[j] for j in full], [features[j] for j in full], T)
            out = self.model.prefill(tokens.to(device), lengths.to(device),
                                     torch.tensor([firsts[j] for j in full], device=device), self.cache,
                                     *([mm] if mm is not None else []))
            routes = None if self.invariant else getattr(self.model, "last_routes", None)
            for i, j in enumerate(full):
                logits[j] = out[i]
                reqs[j].prompt_route = None if routes is None else routes[i].cpu()
        # The n samples share the prompt's prefill: copy its KV to their slots.
        for r, first in zip(reqs, firsts):
            for j in range(1, r.sampling.n):
                self.cache.move(first, first + j, len(r.prompt))
        owner = [i for i, r in enumerate(reqs) for _ in range(r.sampling.n)]
        self.running += new
        self._append(new, torch.stack([logits[i] for i in owner]))
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(len(r.prompt) - start for r, start in zip(reqs, reused))
        self.stats["prefix_reused_tokens"] += sum(reused)
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _image_features(self, reqs: list[Request], starts: list[int]) -> list[list[torch.Tensor] | None]:
        """Per request, the vision tower's features of the image-pad tokens it computes (those at
        or after its reused prefix), from one tower call for the whole prefill: [features, then
        Qwen3-VL's deep-stack features per layer], each [tokens, H]; None without images."""
        wanted = [None if r.images is None else [i for i, (_, end) in enumerate(r.images.spans) if end > start]
                  for r, start in zip(reqs, starts)]
        chosen = [(r.images.subset(w)) for r, w in zip(reqs, wanted) if w]
        if not chosen:
            return [None] * len(reqs)
        features, deepstack = self.model.encode_images(torch.cat([p for p, _ in chosen]),
                                                       torch.cat([g for _, g in chosen]))
        sizes = [sum(e - b for b, e in (r.images.spans[i] for i in w)) if w else 0 for r, w in zip(reqs, wanted)]
        per_level = [level.split(sizes) for level in (features, *deepstack)]
        out: list[list[torch.Tensor] | None] = []
        for j, (r, w, start) in enumerate(zip(reqs, wanted, starts)):
            # an image that began before `start` is already cached up to there: keep its tail
            skip = max(0, start - r.images.spans[w[0]][0]) if w else 0
            out.append([parts[j][skip:] for parts in per_level] if w else None)
        return out

    def _prefill_inputs(self, reqs: list[Request], features: list[list[torch.Tensor] | None],
                        T: int) -> MultimodalInputs | None:
        """M-RoPE ids [3, P, T] and image features of a prefill batch that holds images."""
        if all(r.images is None for r in reqs):
            return None
        positions = torch.arange(T).expand(3, len(reqs), T).clone()  # text rows and pads: plain
        for i, r in enumerate(reqs):
            if r.images is not None:
                positions[:, i, : len(r.prompt)] = r.images.positions
        return _multimodal(positions.to(self.model.device), [f for f in features if f is not None])

    def _decode(self) -> None:
        t0 = time.perf_counter()
        device = self.model.device
        live = self.running
        positions = [s.length - 1 for s in live]
        attend_len = max(positions) + 1
        self.cache.fit(len(live), attend_len)
        rotary = [] if self.vision is None else self._rope_positions(live, positions)
        logits = self.model.decode(
            torch.tensor([s.tokens[-1] for s in live], device=device),
            torch.tensor(positions, device=device),
            self.cache,
            attend_len,
            *([torch.tensor(rotary, device=device)] if rotary else []),
        )
        routes = getattr(self.model, "last_routes", None)
        if routes is not None:  # the routes of each sequence's input token, its newest generated one
            for s, r in zip(live, routes.cpu()):
                s.routes.append(r)
        self._append(live, logits)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(live)
        self.stats["decode_s"] += time.perf_counter() - t0

    @staticmethod
    def _rope_positions(live: list[Sequence], positions: list[int]) -> list[int]:
        """Decode rope positions (cache index + rope delta); [] when every delta is 0 (text)."""
        deltas = [0 if s.request.images is None else s.request.images.rope_delta for s in live]
        return [p + d for p, d in zip(positions, deltas)] if any(deltas) else []

    def _append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens, logprobs, top = sample(logits, [s.row for s in seqs], normalized=self.invariant)
        streamed: dict[Request, list[SampleDelta]] | None = None
        for b, s in enumerate(seqs):
            s.tokens.append(tokens[b])
            if s.request.sampling.logprobs:
                s.logprobs.append(logprobs[b])
            if top is not None and top[b] is not None:
                s.top_logprobs.append(top[b])
            s.stop_reason = self._stop_reason(s)
            if s.request.on_step is not None:
                streamed = streamed if streamed is not None else {}
                streamed.setdefault(s.request, []).append(self._delta(s))
        for req, deltas in (streamed or {}).items():
            req.on_step(StreamUpdate(sorted(deltas, key=lambda d: d.index)))

    def _delta(self, s: Sequence) -> SampleDelta:
        """The token `_append` just added to `s`, as a stream delta."""
        top = s.top_logprobs[-1:] if s.request.sampling.top_logprobs else None
        finished = self._output(s) if s.stop_reason is not None else None
        return SampleDelta(s.index, s.tokens[-1:], s.logprobs[-1:], top, finished)

    def _stop_reason(self, s: Sequence) -> str | None:
        sp, tok = s.request.sampling, s.tokens[-1]
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if sp.stop:
            # A stop string that just completed lies in the last few tokens (each decodes to at
            # least one character): scan that tail, decode everything only on a hit.
            tail = max(len(stop) for stop in sp.stop) + 4
            if any(stop in self.tokenizer.decode(s.tokens[-tail:], skip_special_tokens=True) for stop in sp.stop):
                text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
                s.text = text[: min(i for i in (text.find(stop) for stop in sp.stop) if i >= 0)]
                return "stop"
        if len(s.tokens) >= sp.max_tokens or s.length >= self.max_model_len:
            return "length"
        return None

    # -- leaving --------------------------------------------------------------------------------

    def _retire(self) -> list[Request]:
        """Drop finished sequences, refilling their slots from the tail so live slots stay 0..B-1."""
        live = [s for s in self.running if s.stop_reason is None]
        if len(live) == len(self.running):
            return []
        gone = [s for s in self.running if s.stop_reason is not None]
        if self.cache.prefix_budget:  # before the holes are refilled: keep what may be extended
            for slot, s in enumerate(self.running):
                if s.stop_reason in ("stop", "length") and self._reusable(s):
                    self.cache.stash(slot, s.request.prompt + s.tokens[:-1],  # the last is not cached
                                     s.request.images.keys if s.request.images else ())
        keep = len(live)
        holes = [i for i, s in enumerate(self.running[:keep]) if s.stop_reason is not None]
        movers = [i for i, s in enumerate(self.running[keep:], start=keep) if s.stop_reason is None]
        for hole, src in zip(holes, movers):
            self.cache.move(src, hole, self.running[src].length - 1)
            self.running[hole] = self.running[src]
        self.running = self.running[:keep]
        return [r for r in dict.fromkeys(s.request for s in gone) if self._maybe_finish(r)]

    def _reusable(self, s: Sequence) -> bool:
        """Whether a finished sequence's K/V may serve a later prompt: on a vision-language model
        not when it sampled an image-pad token (its K/V there is the token's, not an image's, and
        a later prompt would read it as an image's)."""
        return self.vision is None or self.vision.image_token_id not in s.tokens

    def _maybe_finish(self, req: Request) -> bool:
        if req.done or any(s.stop_reason is None for s in req.seqs):
            return False
        req.outputs = [self._output(s) for s in req.seqs]
        return True

    def _output(self, s: Sequence) -> TokenOutput:
        text = s.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        return TokenOutput(
            token_ids=list(s.tokens),
            logprobs=list(s.logprobs),
            stop_reason=s.stop_reason,
            weight_version=self.weight_version,
            top_logprobs=list(s.top_logprobs) if s.request.sampling.top_logprobs else None,
            text=text,
            prompt_tokens=len(s.request.prompt),
            extra={"min_weight_version": s.min_version, "max_weight_version": s.max_version,
                   **({"routed_experts": routed_experts(s.routes, len(s.tokens), self.model.spec.moe),
                       "prompt_routed_experts": s.request.prompt_route}
                      if self.model.spec.moe is not None else {})},
        )

    # -- control --------------------------------------------------------------------------------

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version
        self.cache.clear_prefixes()  # their KV came from the old weights
        for s in self.running:
            s.min_version = min(s.min_version, version)
            s.max_version = max(s.max_version, version)

    @torch.inference_mode()
    def cancel(self, req: Request) -> None:
        """Drop one request (its caller went away); its sequences free their slots now."""
        if req in self.waiting:
            self.waiting.remove(req)
            return
        for s in req.seqs:
            if s.stop_reason is None:
                s.stop_reason = "aborted"
        self._retire()

    def abort_all(self) -> list[Request]:
        """Every queued or running request completes now with what it has, stop_reason="aborted"."""
        reqs = list(dict.fromkeys(s.request for s in self.running)) + list(self.waiting)
        self.running, self.waiting = [], deque()
        for req in reqs:
            if not req.seqs:
                req.seqs = [self._new_sequence(req, i) for i in range(req.sampling.n)]
            for s in req.seqs:
                if s.stop_reason is None:
                    s.stop_reason = "aborted"
            req.outputs = [self._output(s) for s in req.seqs]
        return reqs


def _multimodal(positions: torch.Tensor, parts: list[list[torch.Tensor]]) -> MultimodalInputs:
    """MultimodalInputs over rows whose image features are `parts` (per row: features, then
    deep-stack levels), concatenated level by level in row order."""
    if not parts:
        return MultimodalInputs(positions)
    levels = [torch.cat(level) for level in zip(*parts)]
    return MultimodalInputs(positions, levels[0], levels[1:])


def _first_route(model) -> torch.Tensor | None:
    """The expert ids [moe layers, k] the model's last one-prompt forward (extend.py) gave its
    last token; None for a dense model (or a forward that records none)."""
    routes = getattr(model, "last_routes", None)
    return None if routes is None else routes[0].cpu()
