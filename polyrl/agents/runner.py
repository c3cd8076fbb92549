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
import threading
import time
import uuid
from typing import Any, Sequence

from polyrl.agents.chat import ChatDelta
from polyrl.agents.config import AgentConfig
from polyrl.agents.environments import ENVIRONMENTS, StepResult, StepStats, ToolEnvironment, as_messages, as_step_result
from polyrl.agents.executor import _in_thread
from polyrl.agents.parsers import get_parser
from polyrl.agents.stats import AgentRollout, Trajectory, TrajectoryStats, to_rollout_batch
from polyrl.agents.tools import Tool, load_tools
from polyrl.rollout.base import SamplingParams

LIMITS = ("turns", "response_tokens", "tool_seconds", "context")


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """A seed per (row seed, sample, turn): reruns reproduce every turn of every sample."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample}/{turn}".encode()).digest()[:7], "little")


class _EnvAdapter:
    """A user `Environment` behind the runner's async step: each step on a thread, with a
    timeout; an environment that raises or hangs ends its trajectory (counted, never a crash)."""

    def __init__(self, env: Any, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s

    async def astep(self, text: str, stats: StepStats, time_left: float, last_turn: bool) -> StepResult:
        start = time.monotonic()
        try:
            value = await asyncio.wait_for(_in_thread(lambda: self.env.step(text), {}),
                                           timeout=max(min(self.timeout_s, time_left), 1e-3))
            result = as_step_result(value)
        except Exception as exc:  # noqa: BLE001 - counted in agent/env_errors
            stats.errors_by_kind["env_timeout" if isinstance(exc, asyncio.TimeoutError) else "env_error"] = 1
            result = StepResult(None, 0.0, True)
        stats.tool_seconds += time.monotonic() - start
        return result


def eos_ids(engine: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a turn: the engine's, else the tokenizer's EOS."""
    return frozenset(getattr(engine, "eos_token_ids", ()) or
                     ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))


class AgentRunner:
    """Holds what every trajectory of a run shares: engine, tokenizer, tools, parser, template."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: AgentConfig, tools: dict[str, Tool] | None = None):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.tools = tools if tools is not None else load_tools(cfg.tools)
        self.parser = get_parser(cfg.tool_parser)
        self._chat: ChatDelta | None = None
        self.eos = eos_ids(engine, tokenizer)

    @property
    def chat(self) -> ChatDelta:
        if self._chat is None:  # single-turn runs never need a chat template
            schemas = [t.schema for t in self.tools.values()] if self.cfg.tools_in_prompt else None
            self._chat = ChatDelta(self.tokenizer, schemas)
        return self._chat

    def _environment(self, row: Any, limit: asyncio.Semaphore) -> tuple[str | None, Any]:
        name = (row.extra_info or {}).get(self.cfg.environment_key) or self.cfg.default_environment
        if name is None:
            return None, None
        if name == "tools":
            return name, ToolEnvironment(self.tools, self.parser, self.cfg.tool_timeout_s, limit)
        return name, ENVIRONMENTS.get(name)(**self.cfg.environment_kwargs)

    async def _first_prompt(self, row: Any, env_name: str | None, env: Any) -> list[int]:
        if env is not None and not isinstance(env, ToolEnvironment):
            observation = await asyncio.wait_for(_in_thread(lambda: env.reset(row), {}), self.cfg.tool_timeout_s)
            if observation is not None:
                return self.chat.prompt_ids(as_messages(observation))
        if env_name == "tools" and self.cfg.tools_in_prompt and isinstance(row.raw_prompt, list):
            return self.chat.prompt_ids([{k: v for k, v in m.items() if v is not None} for m in row.raw_prompt])
        return list(row.prompt_ids)

    async def run_one(self, row: Any, sampling: SamplingParams, sample: int, seed: int | None,
                      group: int, limit: asyncio.Semaphore) -> Trajectory:
        cfg = self.cfg
        env_name, env = self._environment(row, limit)
        stats = TrajectoryStats(environment=env_name)
        try:
            traj = Trajectory(prompt_ids=await self._first_prompt(row, env_name, env), group=group, stats=stats)
            stepper = env if env is None or isinstance(env, ToolEnvironment) else _EnvAdapter(env, cfg.tool_timeout_s)
            await self._turns(traj, stepper, sampling, sample, seed)
        finally:
            if env is not None and hasattr(env, "close"):
                env.close()
        return traj

    async def _turns(self, traj: Trajectory, env: Any, sampling: SamplingParams, sample: int,
                     seed: int | None) -> None:
        cfg, stats = self.cfg, traj.stats
        max_len = getattr(self.engine, "max_model_len", None) or 1 << 62
        request = uuid.uuid4().hex[:12]
        for turn in range(cfg.max_turns):
            budget = min(cfg.max_response_tokens - len(traj.response_ids), max_len - len(traj.context))
            if budget <= 0:
                stats.limit = "response_tokens" if len(traj.response_ids) >= cfg.max_response_tokens else "context"
                return
            sp = dataclasses.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, budget),
                                     seed=turn_seed(seed, sample, turn))
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
            delta = self.chat.delta_ids(messages, last)
            if len(traj.response_ids) + len(delta) >= cfg.max_response_tokens:
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
        jobs = [self.run_one(row, sampling, j, seeds[i], group_offset + i, limit)
                for i, row in enumerate(rows) for j in range(sampling.n)]
        trajectories = list(await asyncio.gather(*jobs))
        for traj, (i, row) in zip(trajectories, [(i, r) for i, r in enumerate(rows) for _ in range(sampling.n)]):
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
