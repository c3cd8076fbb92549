"""The multi-turn trajectory runner: engine turns, tool / environment turns, one RolloutBatch.

    rollout = run_trajectories_sync(engine, tokenizer, rows, sampling, agent_cfg, seeds=seeds)
    rollout.batch       # RolloutBatch: response = every turn after the prompt, loss_mask per token
    rollout.metrics()   # agent/turns_mean, agent/tool_calls_mean, agent/tool_errors, ...

A trajectory is `prompt_ids + response_ids`, grown only by appending: each assistant turn's ids
exactly as the engine sampled them (loss_mask 1, with their log-probs), then the template's delta
for the tool / environment turn (loss_mask 0, log-prob 0). The next turn's prompt *is* that
concatenation, so the ids the trainer sees are the ids the engine saw and sampled - nothing is
decoded and re-encoded (polyrl/agents/chat.py). Trajectories run concurrently; the engine
batches their turns (continuous batching), tools run on threads meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from typing import Any, Sequence

from polyrl.agents.chat import ChatDelta, TemplateError
from polyrl.agents.config import AgentConfig
from polyrl.agents.environments import ENVIRONMENTS, StepResult, StepStats, ToolEnvironment, as_messages, as_step_result
from polyrl.agents.executor import STUCK, STUCK_PER_PARALLEL_CALL, Outcome, call_in_thread, describe
from polyrl.agents.parsers import get_parser
from polyrl.agents.stats import AgentRollout, Trajectory, TrajectoryStats, to_rollout_batch
from polyrl.agents.tools import Tool, load_agent_tools
from polyrl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)
LIMITS = ("turns", "response_tokens", "tool_seconds", "context")


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """A seed per (row seed, sample, turn): reruns reproduce every turn of every sample."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample}/{turn}".encode()).digest()[:7], "little")


class TurnGate:
    """Lockstep turns (`agent.lockstep_turns`): a trajectory's next engine turn waits until every
    trajectory of the batch still running waits for its own, then all go in trajectory order, in
    one pass of the event loop. The engine's batches (and so its log-probs, which depend on what
    is batched together) then do not depend on how long each tool or environment step took."""

    def __init__(self, members: int):
        self.members = members
        self.waiting: dict[int, asyncio.Future] = {}

    async def next_turn(self, member: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting[member] = fut
        self._release()
        try:
            await fut
        finally:
            if self.waiting.get(member) is fut:  # cancelled while waiting
                del self.waiting[member]

    def leave(self) -> None:
        """A trajectory ended (or failed): the others no longer wait for it."""
        self.members -= 1
        self._release()

    def _release(self) -> None:
        if self.waiting and len(self.waiting) >= self.members:
            waiting, self.waiting = self.waiting, {}
            # woken from a callback of their own, not from here: the trajectory whose arrival
            # completes the set must not go first (its future would be done before it awaits it)
            asyncio.get_running_loop().call_soon(self._wake, waiting)

    @staticmethod
    def _wake(waiting: dict[int, asyncio.Future]) -> None:
        for member in sorted(waiting):  # wake-ups run in this order: requests queue in it
            if not waiting[member].done():
                waiting[member].set_result(None)


class _EnvAdapter:
    """A user `Environment` behind the runner's async calls. Its constructor, `reset`, `step` and
    `close` each run on a thread with `agent.tool_timeout_s` (the tools' mechanism,
    executor.call_in_thread); one that raises, hangs or returns something unusable ends the
    trajectory (a failing `close` only is counted: the trajectory was complete), counted in
    agent/env_errors by kind (env_error, env_timeout, env_bad_output) - never a crash."""

    def __init__(self, name: str, factory: Any, kwargs: dict[str, Any], timeout_s: float, stuck_limit: int,
                 report: Any):
        self.name, self.factory, self.kwargs = name, factory, kwargs
        self.timeout_s, self.stuck_limit, self.report = timeout_s, stuck_limit, report
        self.env: Any = None

    def _fail(self, errors: dict[str, int], kind: str, message: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1
        self.report(f"environment '{self.name}': {message}")

    async def _call(self, what: str, fn: Any, errors: dict[str, int], timeout_s: float | None = None) -> Outcome | None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        out = await call_in_thread(fn, timeout_s, self.stuck_limit)
        if out.error == "raised":
            self._fail(errors, "env_error", f"{what} raised {describe(out.exception)}")
        elif out.error == "timeout":
            self._fail(errors, "env_timeout", f"{what} did not finish within {timeout_s:g} s")
        elif out.error == "not_run":
            self._fail(errors, "env_timeout", f"{what} was not run: {STUCK.count} earlier calls are still "
                       "running past their timeout")
        return out if out.error is None else None

    async def open(self, row: Any, stats: TrajectoryStats) -> list[dict] | None:
        """Build the environment and reset it: the first prompt's messages ([]: the row's own
        prompt), or None when either failed (counted)."""
        errors: dict[str, int] = {}
        try:
            out = await self._call("the constructor", lambda: self.factory(**self.kwargs), errors)
            if out is None:
                return None
            self.env = out.value
            out = await self._call("reset", lambda: self.env.reset(row), errors)
            if out is None:
                return None
            try:
                return as_messages(out.value)
            except TypeError as exc:
                self._fail(errors, "env_bad_output", f"reset returned {exc}")
                return None
        finally:
            stats.add_errors(errors)

    async def astep(self, text: str, stats: StepStats, time_left: float, last_turn: bool) -> StepResult:
        start = time.monotonic()
        out = await self._call("step", lambda: self.env.step(text), stats.errors_by_kind,
                               max(min(self.timeout_s, time_left), 1e-3))
        stats.tool_seconds += time.monotonic() - start
        if out is None:
            return StepResult(None, 0.0, True)
        try:
            result = as_step_result(out.value)
            return StepResult(as_messages(result.observation), result.reward, result.done)
        except (TypeError, ValueError) as exc:
            self._fail(stats.errors_by_kind, "env_bad_output", f"step returned {exc}")
            return StepResult(None, 0.0, True)

    async def close(self, stats: TrajectoryStats) -> None:
        if self.env is None or not callable(getattr(self.env, "close", None)):
            return
        errors: dict[str, int] = {}
        await self._call("close", self.env.close, errors)
        stats.add_errors(errors)

    def bad_observation(self, stats: TrajectoryStats, exc: Exception) -> None:
        """The chat template could not render what the environment returned (counted)."""
        errors: dict[str, int] = {}
        self._fail(errors, "env_bad_output", f"its observation cannot be rendered by the chat template: "
                   f"{describe(exc)}")
        stats.add_errors(errors)


def eos_ids(engine: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a turn: the engine's, else the tokenizer's EOS."""
    return frozenset(getattr(engine, "eos_token_ids", ()) or
                     ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))


class AgentRunner:
    """Holds what every trajectory of a run shares: engine, tokenizer, tools, parser, template."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: AgentConfig, tools: dict[str, Tool] | None = None):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.tools = tools if tools is not None else load_agent_tools(cfg)
        self.parser = get_parser(cfg.tool_parser)
        self._chat: ChatDelta | None = None
        self.eos = eos_ids(engine, tokenizer)
        self.stuck_limit = STUCK_PER_PARALLEL_CALL * cfg.max_parallel_tools
        self._reported = False

    @property
    def chat(self) -> ChatDelta:
        if self._chat is None:  # single-turn runs never need a chat template
            schemas = [t.schema for t in self.tools.values()] if self.cfg.tools_in_prompt else None
            self._chat = ChatDelta(self.tokenizer, schemas)
        return self._chat

    @property
    def max_len(self) -> int:
        return getattr(self.engine, "max_model_len", None) or 1 << 62

    def report(self, message: str) -> None:
        """Log the first environment failure of a rollout (the counters say how often)."""
        if not self._reported:
            self._reported = True
            logger.warning("%s (counted in agent/env_errors; the trajectory ends there)", message)

    def _environment(self, row: Any, limit: asyncio.Semaphore) -> tuple[str | None, Any]:
        name = (row.extra_info or {}).get(self.cfg.environment_key) or self.cfg.default_environment
        if name is None:
            return None, None
        if name == "tools":
            return name, ToolEnvironment(self.tools, self.parser, self.cfg.tool_timeout_s, limit, self.stuck_limit)
        factory = ENVIRONMENTS.get(name)  # an unknown name is a set-up error: it raises, naming the choices
        return name, _EnvAdapter(name, factory, self.cfg.environment_kwargs, self.cfg.tool_timeout_s,
                                 self.stuck_limit, self.report)

    async def _first_prompt(self, row: Any, env_name: str | None, env: Any, stats: TrajectoryStats) -> list[int] | None:
        """The first prompt's ids; None when a user environment failed to start (counted)."""
        if isinstance(env, _EnvAdapter):
            messages = await env.open(row, stats)
            if messages is None:
                return None
            if messages:
                try:
                    ids = self.chat.prompt_ids(messages)
                except TemplateError:
                    raise
                except Exception as exc:  # noqa: BLE001 - e.g. a role the template refuses
                    env.bad_observation(stats, exc)
                    return None
                if len(ids) >= self.max_len:
                    env.bad_observation(stats, ValueError(
                        f"reset's prompt is {len(ids)} tokens, the engine's max_model_len is {self.max_len}"))
                    return None
                return ids
        if env_name == "tools" and self.cfg.tools_in_prompt and isinstance(row.raw_prompt, list):
            return self.chat.prompt_ids([{k: v for k, v in m.items() if v is not None} for m in row.raw_prompt])
        return list(row.prompt_ids)

    async def run_one(self, row: Any, sampling: SamplingParams, sample: int, seed: int | None,
                      group: int, limit: asyncio.Semaphore, gate: TurnGate | None = None,
                      member: int = 0) -> Trajectory:
        try:
            env_name, env = self._environment(row, limit)
            stats = TrajectoryStats(environment=env_name)
            traj = Trajectory(prompt_ids=list(row.prompt_ids), group=group, stats=stats)
            try:
                prompt = await self._first_prompt(row, env_name, env, stats)
                if prompt is None:  # the environment never started: no turn, no loss
                    return traj
                traj.prompt_ids = prompt
                await self._turns(traj, env, sampling, sample, seed, gate, member)
            finally:
                if isinstance(env, _EnvAdapter):
                    await env.close(stats)
            return traj
        finally:
            if gate is not None:
                gate.leave()

    async def _turns(self, traj: Trajectory, env: Any, sampling: SamplingParams, sample: int,
                     seed: int | None, gate: TurnGate | None = None, member: int = 0) -> None:
        cfg, stats = self.cfg, traj.stats
        max_len = self.max_len
        request = uuid.uuid4().hex[:12]
        for turn in range(cfg.max_turns):
            budget = min(cfg.max_response_tokens - len(traj.response_ids), max_len - len(traj.context))
            if budget <= 0:
                stats.limit = "response_tokens" if len(traj.response_ids) >= cfg.max_response_tokens else "context"
                return
            sp = dataclasses.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, budget),
                                     seed=turn_seed(seed, sample, turn))
            if gate is not None:  # nothing may await between the gate and the engine's queue
                await gate.next_turn(member)
            out = (await self.engine.generate(traj.context, sp, f"{request}-{sample}/{turn}"))[0]
            traj.add_turn(out, self.tokenizer)
            stats.turns += 1
            if out.stop_reason != "stop":  # cut by a limit or aborted: the episode is over
                if out.stop_reason == "length" and len(out.token_ids) >= budget and budget < sampling.max_tokens:
                    stats.limit = "response_tokens" if len(traj.response_ids) >= cfg.max_response_tokens else "context"
                return
            if env is None:
                return
            time_left = cfg.max_tool_seconds - stats.tool_seconds
            step_stats = StepStats()
            result = await env.astep(traj.final_text, step_stats, time_left, turn == cfg.max_turns - 1)
            stats.add(step_stats, result.reward)
            if result.done:
                return
            if turn == cfg.max_turns - 1:
                stats.limit = "turns"
                return
            messages = as_messages(result.observation)
            if not messages:  # nothing to show the model: let it go on from where it stopped
                continue
            last = out.token_ids[-1] if out.token_ids and out.token_ids[-1] in self.eos_stop(sp) else None
            room = cfg.max_response_tokens - len(traj.response_ids)
            try:
                # a delta of `room` tokens or more ends the trajectory: a longer one is not tokenized in full
                delta = self.chat.delta_ids_within(messages, last, room - 1)
            except TemplateError:
                raise
            except Exception as exc:  # noqa: BLE001 - a user environment's message the template refuses
                if not isinstance(env, _EnvAdapter):
                    raise
                env.bad_observation(stats, exc)
                return
            if len(delta) >= room:
                stats.limit = "response_tokens"
                return
            traj.add_observation(delta, messages)
            if stats.tool_seconds >= cfg.max_tool_seconds:
                stats.limit = "tool_seconds"
                return

    def eos_stop(self, sp: SamplingParams) -> frozenset[int]:
        return self.eos | frozenset(sp.stop_token_ids)

    async def run(self, rows: Sequence[Any], sampling: SamplingParams, seeds: Sequence[int | None] | None = None,
                  group_offset: int = 0) -> AgentRollout:
        sampling.validate()
        seeds = list(seeds) if seeds is not None else [sampling.seed] * len(rows)
        limit = asyncio.Semaphore(self.cfg.max_parallel_tools)
        slots = [(i, row, j) for i, row in enumerate(rows) for j in range(sampling.n)]
        gate = TurnGate(len(slots)) if self.cfg.lockstep_turns else None
        jobs = [self.run_one(row, sampling, j, seeds[i], group_offset + i, limit, gate, k)
                for k, (i, row, j) in enumerate(slots)]
        trajectories = list(await asyncio.gather(*jobs))
        for traj, (_, row, _) in zip(trajectories, slots):
            traj.row = row
        return AgentRollout(to_rollout_batch(trajectories, self.eos), trajectories)


async def run_trajectories(engine: Any, tokenizer: Any, rows: Sequence[Any], sampling: SamplingParams,
                           agent_cfg: AgentConfig, *, seeds: Sequence[int | None] | None = None,
                           group_offset: int = 0, tools: dict[str, Tool] | None = None) -> AgentRollout:
    """`sampling.n` trajectories per row (GRPO groups: samples of row i get group_offset + i):
    the built-in turn loop with tools / environments, or a black-box agent (black_box.py)."""
    if agent_cfg.black_box is not None:
        from polyrl.agents.black_box import BlackBoxRunner

        return await BlackBoxRunner(engine, tokenizer, agent_cfg).run(rows, sampling, seeds, group_offset)
    runner = AgentRunner(engine, tokenizer, agent_cfg, tools)
    return await runner.run(rows, sampling, seeds, group_offset)


def run_trajectories_sync(*args: Any, **kwargs: Any) -> AgentRollout:
    """`run_trajectories` from synchronous code (a trainer thread, a Ray actor method). Inside a
    running event loop it runs on a private loop in a helper thread instead of nesting."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_trajectories(*args, **kwargs))
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = asyncio.run(run_trajectories(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = exc

    thread = threading.Thread(target=work, name="polyrl-agent-rollout")
    thread.start()
    thread.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
