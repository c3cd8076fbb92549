"""Generation and weight updates taking turns inside one asynchronous rollout replica.

A replica serves several generation calls at once (threads of a Ray actor) while the trainer
publishes new weights. `WeightGate` stands between them and the engine: a weight update first
stops new generation from starting, then either

    abort  aborts every in-flight request (`engine.abort_all()`: each returns what it has so
           far, stop_reason="aborted"), applies the new weights at once, and lets the callers
           continue each aborted sample from its tokens so far (partial rollout, as in AReaL
           arXiv:2505.24298 and slime); or
    wait   lets in-flight requests finish on the old weights, then applies.

`generate_resumable` is the caller's side: it runs a batch through the gate and continues
aborted samples with a new request whose prompt is the original prompt plus the tokens generated
so far and whose `max_tokens` is what remains; pieces are concatenated (tokens, log-probs, and a
mixture-of-experts engine's routes: the earlier piece's last token takes the routes the
continuation's prefill gave it, so the whole response replays; polyrl/batch/routes.py `joined`)
and the sample records the oldest and newest policy version that produced any of its tokens.

Seeds: a request that was aborted before producing any token is resubmitted unchanged (same seed,
same n), so it draws exactly what it would have. A continued sample draws its remaining tokens
from a new stream seeded by (seed, sample index, tokens so far): reproducible for the same abort
points, but the abort points depend on when weights arrive, so a run with partial rollouts is not
bit-for-bit repeatable (wait mode is, for the same weight-arrival order).
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any, Literal

from polyrl.batch.routes import cut, joined
from polyrl.rollout.base import SamplingParams, TokenOutput


class WeightGate:
    """Looks like an engine to a weight transport (`weight_version`, `update_weights`); makes
    generation and updates take turns as the `policy` says."""

    def __init__(self, engine: Any, policy: Literal["abort", "wait"] = "abort", poll_s: float = 0.02):
        if policy not in ("abort", "wait"):
            raise ValueError(f"async.partial_rollout={policy!r}; valid choices: abort, wait")
        self.engine, self.policy, self.poll_s = engine, policy, poll_s
        self._cond = threading.Condition()
        self._update_lock = threading.Lock()  # one update at a time
        self._paused = False
        self._active = 0
        self.aborted_requests = 0
        """Requests aborted by weight updates since start."""

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def active(self) -> int:
        with self._cond:
            return self._active

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Held while a generation call runs; waits while an update is being applied."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    @asynccontextmanager
    async def generating_async(self) -> AsyncIterator[None]:
        """`generating` for a coroutine. While an update is applied, the wait runs on a thread of
        its own, so the event loop keeps delivering the aborted outputs the update is waiting for,
        and the loop's executor threads stay free for the engine's steps (with `wait` the update
        waits for running turns, which step there: waiting turns holding those threads would
        deadlock it)."""
        if not self._try_enter():
            await self._enter_on_own_thread()
        try:
            yield
        finally:
            self._leave()

    def _try_enter(self) -> bool:
        with self._cond:
            if self._paused:
                return False
            self._active += 1
            return True

    async def _enter_on_own_thread(self) -> None:
        loop = asyncio.get_running_loop()
        entered: asyncio.Future = loop.create_future()

        def deliver() -> None:
            if entered.cancelled():  # the caller went away while it waited: it will not leave
                self._leave()
            else:
                entered.set_result(None)

        def wait() -> None:
            self._enter()
            try:
                loop.call_soon_threadsafe(deliver)
            except RuntimeError:  # the caller's loop is gone
                self._leave()

        threading.Thread(target=wait, name="polyrl-gate-wait", daemon=True).start()
        await entered

    def _enter(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)
            self._active += 1

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        with self._update_lock:
            with self._cond:
                self._paused = True
            try:
                if self.policy == "abort":
                    # repeat: a call that passed the gate just before the pause may queue its
                    # requests after an abort; it is aborted on the next round
                    while True:
                        with self._cond:
                            if self._active == 0:
                                break
                        self.aborted_requests += self.engine.abort_all()
                        with self._cond:
                            self._cond.wait_for(lambda: self._active == 0, timeout=self.poll_s)
                else:
                    with self._cond:
                        self._cond.wait_for(lambda: self._active == 0)
                self.engine.update_weights(named_tensors, version)
            finally:
                with self._cond:
                    self._paused = False
                    self._cond.notify_all()


def continuation_seed(seed: int | None, index: int, done: int) -> int | None:
    """Seed of the rest of sample `index` after `done` tokens (stable across processes)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{index}/{done}".encode()) & 0x7FFFFFFF


def merge(first: TokenOutput, rest: TokenOutput, sp: SamplingParams | None = None,
          tokenizer: Any = None) -> TokenOutput:
    """`first` (aborted) followed by its continuation `rest`; with the request's `sp` and the
    engine's tokenizer, cut where a stop string that straddles the two pieces ends (the engine
    checked each piece alone)."""
    lo = min(_versions(first)[0], _versions(rest)[0])
    hi = max(_versions(first)[1], _versions(rest)[1])
    merged = replace(
        rest,
        token_ids=list(first.token_ids) + list(rest.token_ids),
        logprobs=list(first.logprobs) + list(rest.logprobs),
        # one set of alternatives per token, when they were asked for
        top_logprobs=(list(first.top_logprobs) + list(rest.top_logprobs)
                      if first.top_logprobs is not None and rest.top_logprobs is not None else None),
        text=None,
        prompt_tokens=first.prompt_tokens,
        extra={**rest.extra, "min_weight_version": lo, "max_weight_version": hi,
               "continuations": first.extra.get("continuations", 0) + 1, **_merged_routes(first, rest)},
    )
    return _cut_at_straddling_stop(merged, len(first.token_ids), sp, tokenizer)


def _merged_routes(first: TokenOutput, rest: TokenOutput) -> dict[str, Any]:
    """A mixture-of-experts engine's routes of the whole sample (polyrl/batch/routes.py `joined`):
    every segment's, so the trainer replays the whole response (`actor.router_replay=R3`); none
    where a segment has none (the trainer routes that sample itself)."""
    a, b = first.extra.get("routed_experts"), rest.extra.get("routed_experts")
    if a is None and b is None:
        return {}
    prompt = {"prompt_routed_experts": first.extra.get("prompt_routed_experts")}
    if a is None or b is None or len(a) != len(first.token_ids) or len(b) != len(rest.token_ids):
        return {"routed_experts": None, **prompt}
    return {"routed_experts": joined(a, rest.extra.get("prompt_routed_experts"), b), **prompt}


def _cut_at_straddling_stop(out: TokenOutput, boundary: int, sp: SamplingParams | None, tokenizer: Any) -> TokenOutput:
    """`out` as the uninterrupted request would have ended it: after the token that completes a
    stop string begun before `boundary` (the engine's rule, polyrl/rollout/native/scheduler.py:
    the ids keep that token, the text ends before the stop string). Such a string ends within
    its length (+ a few tokens of slack for multi-byte characters) after the boundary."""
    if sp is None or not sp.stop or tokenizer is None or boundary == 0:
        return out
    ids = list(out.token_ids)
    for k in range(boundary + 1, min(len(ids), boundary + max(len(s) for s in sp.stop) + 4) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        hits = [i for i in (text.find(stop) for stop in sp.stop) if i >= 0]
        if hits:
            routes = out.extra.get("routed_experts")
            extra = out.extra if routes is None else {**out.extra, "routed_experts": cut(routes, k)}
            return replace(out, token_ids=ids[:k], logprobs=list(out.logprobs[:k]),
                           top_logprobs=None if out.top_logprobs is None else list(out.top_logprobs[:k]),
                           text=text[:min(hits)], stop_reason="stop", extra=extra)
    if out.stop_reason == "stop":  # the continuation stopped on one: the text ends before it
        text = tokenizer.decode(ids, skip_special_tokens=True)
        hits = [i for i in (text.find(stop) for stop in sp.stop) if i >= 0]
        if hits:
            return replace(out, text=text[:min(hits)])
    return out


def _versions(out: TokenOutput) -> tuple[int, int]:
    return (out.extra.get("min_weight_version", out.weight_version),
            out.extra.get("max_weight_version", out.weight_version))


def generate_resumable(engine: Any, gate: WeightGate, prompts: Sequence[Sequence[int]],
                       params: Sequence[SamplingParams]) -> list[list[TokenOutput]]:
    """`engine.generate_batch(prompts, params)` through `gate`, continuing aborted samples until
    every sample has stopped (stop / length)."""
    with gate.generating():
        outputs = [list(o) for o in engine.generate_batch(prompts, list(params))]
    while True:
        fresh, partial = [], []  # (prompt i) never started / (prompt i, sample j) to continue
        for i, outs in enumerate(outputs):
            again, rest = continue_aborted(outs, prompts[i], params[i])
            if again:
                fresh.append(i)
            partial += [(i, j, p, sp) for j, p, sp in rest]
        if not fresh and not partial:
            return outputs
        requests = [(list(prompts[i]), params[i]) for i in fresh] + [(p, sp) for _, _, p, sp in partial]
        with gate.generating():
            results = engine.generate_batch([p for p, _ in requests], [sp for _, sp in requests])
        for i, res in zip(fresh, results):
            outputs[i] = list(res)
        for (i, j, _, _), res in zip(partial, results[len(fresh):]):
            outputs[i][j] = merge(outputs[i][j], res[0], params[i], getattr(engine, "tokenizer", None))


def continue_aborted(outs: Sequence[TokenOutput], prompt: Sequence[int], sp: SamplingParams
                     ) -> tuple[bool, list[tuple[int, list[int], SamplingParams]]]:
    """What to request again for one prompt's outputs: (resubmit the prompt unchanged - nothing
    was generated yet -, [(sample index, prompt + tokens so far, the rest's sampling)])."""
    if all(o.stop_reason == "aborted" and not o.token_ids for o in outs):
        return True, []
    return False, [(j, list(prompt) + list(o.token_ids), replace(
        sp, n=1, max_tokens=sp.max_tokens - len(o.token_ids), seed=continuation_seed(sp.seed, j, len(o.token_ids))))
        for j, o in enumerate(outs) if o.stop_reason == "aborted"]


class GatedEngine:
    """An engine whose async `generate` goes through a `WeightGate` and continues samples a weight
    update aborted, like `generate_resumable`: the multi-turn agent loop and the black-box server
    (polyrl/agents) generate through it in an async replica, so a turn is never cut by a weight
    sync; its tokens and log-probs are each those of the policy that sampled it and its output
    records the oldest and newest version (`min_weight_version` / `max_weight_version`).
    Everything else is the engine's (no token stream: servers fall back to whole outputs)."""

    def __init__(self, engine: Any, gate: WeightGate):
        self.engine, self.gate = engine, gate

    def __getattr__(self, name: str) -> Any:
        if name == "generate_stream":  # would bypass the gate
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str | None = None) -> list[TokenOutput]:
        async with self.gate.generating_async():
            outs = list(await self.engine.generate(prompt_ids, sampling, request_id))
        while True:
            fresh, partial = continue_aborted(outs, prompt_ids, sampling)
            if fresh:
                async with self.gate.generating_async():
                    outs = list(await self.engine.generate(prompt_ids, sampling, request_id))
                continue
            if not partial:
                return outs
            async with self.gate.generating_async():
                rests = await asyncio.gather(*(self.engine.generate(p, sp) for _, p, sp in partial))
            for (j, _, _), rest in zip(partial, rests):
                outs[j] = merge(outs[j], rest[0], sampling, getattr(self.engine, "tokenizer", None))
