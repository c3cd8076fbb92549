"""What the engine sampled for each trajectory of a black-box agent (docs/agents.md, level 3).

A black-box agent talks to the OpenAI-compatible server under a per-trajectory base URL
(`/trajectories/<id>/v1`). For every request of an open trajectory the recorder keeps the prompt
ids the engine was given and the `TokenOutput` it returned (sampled ids, log-probs, weight
versions), so the trainer learns from those ids and never from the agent's re-tokenized text.

Prompts are built to extend the previous turn wherever the request allows it, which is what makes
an ordinary OpenAI agent loop token-exact:

- chat: when the request's messages are the previous request's messages plus the assistant reply
  the server returned (as text) plus new messages, the prompt is the previous prompt + the sampled
  ids + the chat template's delta for the new messages (the injected `continuation`, the same
  `ChatDelta` the built-in agent loop uses); otherwise the conversation is rendered afresh;
- completions: a token-id prompt is taken as sent; a text prompt that starts with the previous
  prompt text + the returned text gets the previous ids + the rest encoded as a continuation.

Whether the turns really chain (each prompt extends the previous prompt + sampled ids) is checked
when the trajectory is assembled (polyrl/agents/black_box.py), not here.

In a trajectory the trainer's sampling settings replace the request's (temperature, top-p, top-k,
a seed per turn); a request may lower `max_tokens` and add stop strings or stop token ids, and is
refused if it sets penalties or a logit bias (the trainer's log-probs would not describe what was
sampled). The agent's limits are enforced per request: `TrajectoryLimit` (HTTP 400, code
"trajectory_limit") once a trajectory has used its turns, response tokens or context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from polyrl.rollout.base import RolloutInputError, SamplingParams, TokenOutput


class TrajectoryLimit(RolloutInputError):
    """The trajectory has no turn, response token or context left (its limit is recorded)."""

    code = "trajectory_limit"


class Continuation(Protocol):
    """How to extend a sequence without re-encoding it (polyrl/agents/chat.py `ChatDelta`)."""

    def delta_ids(self, messages: list[dict], last_token: int | None) -> list[int]: ...

    def encode_continuation(self, text: str) -> list[int]: ...


@dataclass
class RecordedTurn:
    prompt_ids: list[int]
    """The ids the engine was given for this turn."""
    output: TokenOutput
    """What it sampled (ids, log-probs, stop reason, weight versions)."""
    added: list[dict]
    """The messages this turn's request added after the previous turn's reply (a completion's
    new text as one {"role": "text"} message): the transcript of the non-sampled tokens."""


@dataclass
class TrajectoryRecord:
    id: str
    sampling: SamplingParams
    """The trainer's sampling settings; `max_tokens` caps every turn."""
    seeds: Callable[[int], int | None]
    """Turn index -> seed of that turn."""
    max_turns: int
    max_response_tokens: int
    turns: list[RecordedTurn] = field(default_factory=list)
    limit: str | None = None
    """The limit a request hit: turns | response_tokens | context."""
    closed: bool = False
    # state for extending the next request (the last turn's)
    context: list[int] = field(default_factory=list)
    messages: list[dict] | None = None
    text: str | None = None
    last_token: int | None = None
    lock: asyncio.Lock | None = None
    inflight: dict = field(default_factory=dict)
    """Engine calls running for this trajectory: task -> its event loop (cancelled on close)."""
    idle: threading.Event = field(default_factory=threading.Event)
    """Set while no engine call of this trajectory runs."""

    def __post_init__(self) -> None:
        self.idle.set()

    def response_tokens(self, prompt: Sequence[int]) -> int:
        """Response tokens a turn with `prompt` starts with (what the prompt holds after the first
        turn's prompt)."""
        return max(len(prompt) - len(self.turns[0].prompt_ids), 0) if self.turns else 0


def normalize_message(message: dict) -> dict:
    """A message as compared between requests: the fields a chat template reads, without the
    empty ones a client echoes back (refusal=None, tool_calls=None, annotations=[] ...)."""
    return {k: v for k, v in message.items() if v is not None and v != [] and v != {}}


class TrajectoryRecorder:
    """Open trajectories by id; the server records each request's turn into its trajectory.

    `open` / `close` are called from the rollout's thread, turns are recorded on the server's
    event loop: the table and each record's `closed` flag are guarded by one lock, so a request
    that finishes after its trajectory was closed is refused, never recorded.
    """

    def __init__(self, continuation: Continuation | None = None):
        self.continuation = continuation
        self._records: dict[str, TrajectoryRecord] = {}
        self._mutex = threading.Lock()

    def open(self, trajectory_id: str, sampling: SamplingParams, *, seeds: Callable[[int], int | None],
             max_turns: int, max_response_tokens: int) -> None:
        with self._mutex:
            if trajectory_id in self._records:
                raise ValueError(f"trajectory {trajectory_id!r} is already open")
            self._records[trajectory_id] = TrajectoryRecord(trajectory_id, sampling, seeds, max_turns,
                                                            max_response_tokens)

    def close(self, trajectory_id: str) -> TrajectoryRecord:
        """Stop recording `trajectory_id` and return its record. Later requests are refused and
        engine calls still running for it (an abandoned agent's) are cancelled; `record.idle` is
        set once they have left the engine."""
        with self._mutex:
            record = self._records.pop(trajectory_id)
            record.closed = True
            running = list(record.inflight.items())
        for task, loop in running:
            loop.call_soon_threadsafe(task.cancel)
        return record

    def get(self, trajectory_id: str) -> TrajectoryRecord:
        with self._mutex:
            record = self._records.get(trajectory_id)
        if record is None:
            raise RolloutInputError("trajectory", f"'{trajectory_id}' is not an open trajectory (polyrl opens "
                                                  "one per rollout sample and closes it when the agent returns)")
        return record

    # -- one request ------------------------------------------------------------------------------

    async def chat_turn(self, trajectory_id: str, engine: Any, messages: list[dict],
                        render: Callable[[list[dict]], list[int]], ask: TurnRequest, *,
                        text: Callable[[TokenOutput], str]) -> tuple[list[int], TokenOutput, SamplingParams]:
        """Generate and record one chat turn; returns (prompt ids, output, the sampling it ran
        with: its stop strings cut a streamed reply like `text`). `text` is the server's
        text of an output: the reply the agent gets, and so the one it echoes back."""
        messages = [normalize_message(m) for m in messages]

        def prompt_of(record: TrajectoryRecord) -> tuple[list[int], list[dict]]:
            prev = record.messages
            if (prev is not None and self.continuation is not None and len(messages) > len(prev)
                    and messages[:len(prev)] == prev):
                new = messages[len(prev):]
                try:
                    return record.context + self.continuation.delta_ids(new, record.last_token), new
                except Exception:  # noqa: BLE001 - a template that cannot be extended turn by turn, or
                    pass  # that rejects the new messages (jinja raise): rendering it all says which
            return render(messages), messages

        def remember(record: TrajectoryRecord, out: TokenOutput) -> None:
            record.messages = messages + [{"role": "assistant", "content": out.text or ""}]
            record.text = None

        return await self._turn(trajectory_id, engine, prompt_of, remember, ask, text, "messages")

    async def completion_turn(self, trajectory_id: str, engine: Any, prompt: str | list[int],
                              encode: Callable[[str], list[int]], ask: TurnRequest, *,
                              text: Callable[[TokenOutput], str]) -> tuple[list[int], TokenOutput, SamplingParams]:
        """Generate and record one completion turn; returns what `chat_turn` does."""
        def prompt_of(record: TrajectoryRecord) -> tuple[list[int], list[dict]]:
            if not isinstance(prompt, str):
                return list(prompt), []
            if record.text is not None and self.continuation is not None and prompt.startswith(record.text):
                rest = prompt[len(record.text):]
                ids = record.context + self.continuation.encode_continuation(rest)
                return ids, [{"role": "text", "content": rest}]
            return encode(prompt), [{"role": "text", "content": prompt}]

        def remember(record: TrajectoryRecord, out: TokenOutput) -> None:
            record.text = prompt + (out.text or "") if isinstance(prompt, str) else None
            record.messages = None

        return await self._turn(trajectory_id, engine, prompt_of, remember, ask, text, "prompt")

    async def _turn(self, trajectory_id: str, engine: Any, prompt_of: Callable, remember: Callable,
                    ask: TurnRequest, text: Callable[[TokenOutput], str],
                    field_name: str) -> tuple[list[int], TokenOutput, SamplingParams]:
        record = self.get(trajectory_id)
        if record.lock is None:  # created on the server's loop; turns of one trajectory take turns
            record.lock = asyncio.Lock()
        async with record.lock:
            turn = len(record.turns)
            if turn >= record.max_turns:
                self._hit(record, "turns")
                raise TrajectoryLimit(field_name, f"trajectory '{trajectory_id}' has used its "
                                                  f"agent.max_turns={record.max_turns} turns")
            prompt, added = prompt_of(record)
            max_len = getattr(engine, "max_model_len", None) or 1 << 62
            left = record.max_response_tokens - record.response_tokens(prompt)
            budget = min(left, max_len - len(prompt))
            if budget <= 0:
                self._hit(record, "response_tokens" if left <= 0 else "context")
                raise TrajectoryLimit(field_name, f"trajectory '{trajectory_id}' has no "
                                                  f"{'response tokens' if left <= 0 else 'context'} left "
                                                  f"(agent.max_response_tokens={record.max_response_tokens})")
            asked = min(record.sampling.max_tokens, ask.max_tokens or record.sampling.max_tokens)
            sp = dataclasses.replace(
                record.sampling, n=1, max_tokens=min(asked, budget), seed=record.seeds(turn), logprobs=True,
                top_logprobs=ask.top_logprobs, stop=tuple(record.sampling.stop) + tuple(ask.stop),
                stop_token_ids=tuple(record.sampling.stop_token_ids) + tuple(ask.stop_token_ids)).validate()
            out = await self._generate(record, engine, prompt, sp, f"{trajectory_id}/{turn}")
            # the text the agent is sent and will echo back; an output without one (a turn that a
            # weight update aborted and that was continued) would otherwise be remembered as ""
            # and the echo would no longer extend the turn
            out = dataclasses.replace(out, text=text(out))
            eos = set(getattr(engine, "eos_token_ids", ()) or ()) | set(sp.stop_token_ids)
            with self._mutex:
                if record.closed:
                    raise self._closed_error(trajectory_id)
                if out.stop_reason == "length" and len(out.token_ids) >= budget and budget < asked:
                    record.limit = "response_tokens" if left <= budget else "context"
                record.turns.append(RecordedTurn(list(prompt), out, added))
                record.context = list(prompt) + list(out.token_ids)
                record.last_token = out.token_ids[-1] if out.token_ids and out.token_ids[-1] in eos else None
                remember(record, out)
            return list(prompt), out, sp

    async def _generate(self, record: TrajectoryRecord, engine: Any, prompt: list[int], sp: SamplingParams,
                        request_id: str) -> TokenOutput:
        """One engine call, cancelled if the trajectory is closed meanwhile (its slots free at once)."""
        task = asyncio.ensure_future(engine.generate(prompt, sp, request_id))
        with self._mutex:
            if record.closed:
                task.cancel()
            record.inflight[task] = asyncio.get_running_loop()
            record.idle.clear()
        try:
            return (await task)[0]
        except asyncio.CancelledError:
            if record.closed and not asyncio.current_task().cancelling():  # closed, not a client leaving
                raise self._closed_error(record.id) from None
            raise
        finally:
            with self._mutex:
                record.inflight.pop(task, None)
                if not record.inflight:
                    record.idle.set()

    def _hit(self, record: TrajectoryRecord, limit: str) -> None:
        """Record the limit a request hit, unless the trajectory is closed (a request that waited
        for the previous turn while its agent timed out): a limit excuses a timeout."""
        with self._mutex:
            if record.closed:
                raise self._closed_error(record.id)
            record.limit = limit

    @staticmethod
    def _closed_error(trajectory_id: str) -> RolloutInputError:
        return RolloutInputError("trajectory", f"'{trajectory_id}' was closed while this request ran (the "
                                               "agent had returned or timed out); nothing was recorded")


@dataclass
class TurnRequest:
    """What a trajectory request may still choose (the trainer's sampling decides the rest)."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0

    @classmethod
    def of(cls, request: Any, max_tokens: int | None, top_logprobs: int) -> "TurnRequest":
        """From an OpenAI request, refusing what would make the log-probs lie about the sampling."""
        if request.n not in (None, 1):
            raise RolloutInputError("n", "a trajectory is one path: n must be 1 (polyrl runs the agent once "
                                         "per sample)")
        for name in ("presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos"):
            if getattr(request, name, None):
                raise RolloutInputError(name, "is not allowed in a training trajectory: it changes what is "
                                              "sampled while the trainer's log-probs describe the plain policy")
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
        return cls(max_tokens, tuple(s for s in stop if s), tuple(request.stop_token_ids or ()), top_logprobs)
