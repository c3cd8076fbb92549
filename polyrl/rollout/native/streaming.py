"""Per-request token streams: what each decode step produced, delivered to an asyncio consumer.

The scheduler runs in a worker thread (or the caller's thread, for `generate_batch`). After every
step that gave a streamed request new tokens it calls the request's `on_step` hook, which hands a
`StreamUpdate` to the request's event loop with `loop.call_soon_threadsafe`; the consumer iterates
the `TokenStream`:

    stream = engine.generate_stream(prompt_ids, SamplingParams(n=2, max_tokens=64))
    async with stream:
        async for update in stream:
            for d in update.deltas:       # d.index: which of the n samples; d.token_ids: new tokens
                ...
            if update.outputs is not None:  # the last update: exactly what generate() returns
                ...

Updates that pile up while the consumer is busy are merged into one (tokens concatenated per
sample), so a slow reader never falls behind by more than one update. Leaving the stream early
(`aclose()`, `async with`, or the consuming task being cancelled) cancels the request in the engine
and frees its KV-cache slots.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from polyrl.rollout.base import TokenOutput


@dataclass
class SampleDelta:
    """New tokens of one of a request's n samples since the previous update."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Empty when the request asked for no log-probs."""
    top_logprobs: list[dict[int, float]] | None = None
    finished: TokenOutput | None = None
    """The sample's final output, set on its last delta (its `text` is cut at a stop string)."""

    def extend(self, later: "SampleDelta") -> None:
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        if later.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + later.top_logprobs
        self.finished = later.finished or self.finished


@dataclass
class StreamUpdate:
    deltas: list[SampleDelta]
    """One entry per sample that advanced, ordered by sample index."""
    outputs: list[TokenOutput] | None = None
    """Set on the final update only: the request's n outputs, as `generate` would return them."""


def merge(updates: list[StreamUpdate]) -> StreamUpdate:
    """Several consecutive updates of one request as one."""
    if len(updates) == 1:
        return updates[0]
    by_index: dict[int, SampleDelta] = {}
    outputs = None
    for update in updates:
        for d in update.deltas:
            if d.index in by_index:
                by_index[d.index].extend(d)
            else:
                by_index[d.index] = SampleDelta(d.index, list(d.token_ids), list(d.logprobs),
                                                list(d.top_logprobs) if d.top_logprobs is not None else None,
                                                d.finished)
        outputs = update.outputs if update.outputs is not None else outputs
    return StreamUpdate([by_index[i] for i in sorted(by_index)], outputs)


_ERROR = object()


class TokenStream:
    """Async iterator of `StreamUpdate`s for one request; see the module docstring.

    Created by `NativeEngine.generate_stream` (already queued in the engine). `cancel` is how the
    engine is told the consumer left; it is called at most once, from the consumer's loop.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, cancel: Callable[[], None]):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = cancel
        self._finished = False

    # -- producer side (any thread) -------------------------------------------------------------

    def push(self, update: StreamUpdate) -> None:
        post_to_loop(self._loop, self._queue.put_nowait, update)

    def fail(self, error: BaseException) -> None:
        post_to_loop(self._loop, self._queue.put_nowait, (_ERROR, error))

    # -- consumer side (the loop) ---------------------------------------------------------------

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> StreamUpdate:
        if self._finished:
            raise StopAsyncIteration
        try:
            items = [await self._queue.get()]
        except asyncio.CancelledError:
            self.close()
            raise
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        errors = [item[1] for item in items if isinstance(item, tuple)]
        if errors:
            self._finished = True
            raise errors[0]
        update = merge(items)
        if update.outputs is not None:
            self._finished = True
        return update

    def close(self) -> None:
        """Stop streaming; an unfinished request is cancelled in the engine (slots freed)."""
        if not self._finished:
            self._finished = True
            self._cancel()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "TokenStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def post_to_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on `loop`; a loop that has already closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
