"""Server-sent-event streams for `/v1/completions` and `/v1/chat/completions` with `stream=true`.

Each engine update (the tokens one decode step added) becomes SSE chunks as soon as it arrives, so
a client reads text while the request is still generating. Text is decoded incrementally per
sample and only the part that is final is sent: an incomplete UTF-8 character waits for its next
byte, and a tail that could still grow into a stop string is held back until it either completes
(the engine then stops and the text is cut there, exactly as in the non-streamed answer) or stops
matching. The concatenated chunks of a sample therefore equal the non-streamed `text`.

Engines without a token stream (`generate_stream`) are served through `finished_stream`: the
request completes first, then its samples are sent as one chunk each.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Sequence

from polyrl.rollout.base import TokenOutput
from polyrl.rollout.native.streaming import SampleDelta, StreamUpdate
from polyrl.rollout.server.openai_format import IncrementalDecoder, TokenText, envelope, finish_reason, usage

logger = logging.getLogger(__name__)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class SampleText:
    """The text of one sample as its tokens arrive; see the module docstring."""

    def __init__(self, text: TokenText, stops: Sequence[str]):
        self._text, self._stops = text, list(stops)
        self._decoder = IncrementalDecoder(text.tokenizer)
        self.sent = ""
        self.finished = False

    @property
    def tokens(self) -> list[int]:
        return self._decoder.tokens

    def add(self, token_ids: list[int]) -> str:
        """New tokens in, the text that became final out ("" if none yet)."""
        if self._text.tokenizer is None or not token_ids:
            self._decoder.tokens += token_ids
            return ""
        text = self._decoder.add(token_ids)
        if not text.startswith(self.sent):  # the decoder revised earlier text: wait for the end
            return ""
        end = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character
        # a stop string starting inside the sent text would have been held back: look after it
        hits = [i for i in (text.find(stop, len(self.sent)) for stop in self._stops) if i >= 0]
        if hits:  # a completed stop string: the engine cuts the text there
            end = min(end, *hits)
        end -= held_back(text[:end], self._stops)
        piece = text[len(self.sent):max(end, len(self.sent))]
        self.sent += piece
        return piece

    def finish(self, out: TokenOutput) -> str:
        """The rest of the final text (cut at a stop string by the engine)."""
        self.finished = True
        final = self._text.text(out)
        return final[len(self.sent):] if final.startswith(self.sent) else ""


class FinishedStream:
    """A completed request as a one-update stream (for engines without `generate_stream`)."""

    def __init__(self, outputs: list[TokenOutput]):
        deltas = [SampleDelta(i, list(o.token_ids), list(o.logprobs), o.top_logprobs, o)
                  for i, o in enumerate(outputs)]
        self._updates = [StreamUpdate(deltas, outputs)]

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamUpdate:
        if not self._updates:
            raise StopAsyncIteration
        return self._updates.pop()

    def close(self) -> None:
        self._updates = []


async def merge_streams(streams: list[Any]) -> AsyncIterator[tuple[int, StreamUpdate]]:
    """(stream index, update) from several streams as each arrives."""
    if len(streams) == 1:
        async for update in streams[0]:
            yield 0, update
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for update in stream:
                queue.put_nowait((i, update))
            queue.put_nowait((i, end))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def close_all(streams: list[Any]) -> None:
    for stream in streams:
        stream.close()


Chunk = Callable[[int, SampleDelta, str, str | None], dict | None]
"""(choice index, delta, text piece, finish_reason or None) -> one choice dict, or None to skip."""


async def sse_events(streams: list[Any], *, n: int, text: TokenText, stops: Sequence[str],
                     kind: str, rid: str, model: str, choice: Chunk, prompt_tokens: int,
                     include_usage: bool, opening: list[dict] = ()) -> AsyncIterator[str]:
    """The SSE body of one streamed request over `streams` (one per prompt, n samples each).

    Closing this generator (the client went away) closes every stream, which cancels the
    unfinished requests in the engine.
    """
    samples: dict[int, SampleText] = {}
    outputs: list[TokenOutput] = []
    ended = False

    def event(choices: list[dict], **extra) -> str:
        return sse(envelope(kind, rid, model, choices, **extra))

    def on_delta(index: int, delta: SampleDelta, out: TokenOutput | None) -> str | None:
        sample = samples.setdefault(index, SampleText(text, stops))
        piece = sample.add(delta.token_ids)
        reason = None
        if out is not None and not sample.finished:
            piece += sample.finish(out)
            reason = finish_reason(out)
        body = choice(index, delta, piece, reason)
        return event([body]) if body is not None else None

    try:
        for body in opening:
            yield event([body])
        async for p, update in merge_streams(streams):
            for d in update.deltas:
                chunk = on_delta(p * n + d.index, d, d.finished)
                if chunk:
                    yield chunk
            if update.outputs is not None:  # samples that ended without a finishing delta (aborts)
                outputs += update.outputs
                for i, out in enumerate(update.outputs):
                    index = p * n + i
                    if not samples.setdefault(index, SampleText(text, stops)).finished:
                        seen = len(samples[index].tokens)
                        rest = SampleDelta(i, list(out.token_ids[seen:]), list(out.logprobs[seen:]),
                                           out.top_logprobs[seen:] if out.top_logprobs else None)
                        chunk = on_delta(index, rest, out)
                        if chunk:
                            yield chunk
        if include_usage:
            yield event([], usage=usage(prompt_tokens, outputs))
        ended = True
        yield sse("[DONE]")
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band
        ended = True
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                             "param": None, "code": None}})
        yield sse("[DONE]")
    finally:
        if not ended:  # closed before its end: the client went away (one line, not a traceback)
            logger.info("%s: client disconnected mid-stream; cancelling its %d sample(s)",
                        rid, n * len(streams))
        close_all(streams)
