"""Environments: multi-step tasks the policy acts in, registered by name, chosen per data row.

    @ENVIRONMENTS.register("guess")
    class Guess(Environment):
        def reset(self, row):
            self.target = int(row.ground_truth)
            return None                      # None: the row's own prompt starts the episode
        def step(self, action_text):
            guess = int(action_text.strip() or -1)
            if guess == self.target:
                return StepResult(None, reward=1.0, done=True)
            return StepResult("higher" if guess < self.target else "lower")

Each trajectory gets a fresh instance (`ENVIRONMENTS.get(name)(**agent.environment_kwargs)`), so
an environment keeps its episode's state in `self`. Outside polyrl, an environment is a class in
the user's own file or package, named by import path (`agent.environment: mypkg.envs:Guess` or
`/path/to/envs.py:Guess`) or registered by a package in the `polyrl.environments` entry-point
group; each rollout worker imports it (docs/plugins.md). The row chooses its environment through
`extra_info[agent.environment_key]` (default key "agent_name", verl's column name); rows without
it use `agent.environment`. An observation is a string (a user turn), one message dict, or a list
of them; it is appended through the chat template and masked out of the loss.

Tool use is the environment named "tools": `step` parses the turn's tool calls, runs them and
returns the results as tool messages; a turn without calls ends the episode.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Union

from polyrl.agents.executor import STUCK_PER_PARALLEL_CALL, error_result, run_calls
from polyrl.agents.parsers import ToolCallParser, parse_safely
from polyrl.agents.tools import Tool
from polyrl.registry import Registry

Observation = Union[str, dict, list]


@dataclass
class StepResult:
    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False


@dataclass
class StepStats:
    """What one step cost; the runner adds these into the trajectory's counters."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)


class Environment:
    """Base class: override `reset` and `step` (both synchronous; they run on a worker thread)."""

    def reset(self, row: Any) -> Observation | None:
        """The episode's first observation, or None to start from the row's prompt."""
        return None

    def step(self, action_text: str) -> StepResult | tuple:
        """React to the text of one assistant turn: (observation, reward, done)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the trajectory ends (free processes, files, ...)."""


ENTRY_POINT_GROUP = "polyrl.environments"


class _Environments(Registry):
    """The registry, plus the integrations named by prefix ("openenv:URL_OR_MODULE",
    polyrl/agents/openenv_env.py): their part after the prefix is no import path."""

    def get(self, name: str) -> Any:
        if name.startswith("openenv:"):
            from polyrl.agents import openenv_env

            return openenv_env.factory(name)
        return super().get(name)


ENVIRONMENTS: Registry[type] = _Environments("agent environment", entry_point_group=ENTRY_POINT_GROUP,
                                             import_paths=True)


def as_messages(observation: Observation | None) -> list[dict]:
    """An observation as chat messages; TypeError (naming what is wrong) for anything else - a
    message that is not a dict, or one without a "role" string or a "content" string."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        messages = [observation]
    elif isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        messages = list(observation)
    else:
        raise TypeError("an observation is a string, a message dict or a list of them, got "
                        f"{type(observation).__name__}")
    for m in messages:
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise TypeError(f"an observation message needs a \"role\" string, got {_brief(m)}")
        # an assistant message may carry only OpenAI tool_calls; every other one needs its text
        if not isinstance(m.get("content"), str) and not (m.get("tool_calls") and m.get("content") is None):
            raise TypeError(f"an observation message needs a \"content\" string, got {_brief(m)}")
    return messages


def as_step_result(value: Any) -> StepResult:
    """`Environment.step`'s return value checked: a StepResult or (observation, reward, done)
    whose reward is a finite number (a 0-d tensor or numpy scalar too) and whose done is a bool;
    TypeError / ValueError naming the problem otherwise."""
    if isinstance(value, tuple) and len(value) == 3:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise TypeError("Environment.step must return StepResult or (observation, reward, done), got "
                        f"{type(value).__name__}")
    reward = 0.0 if value.reward is None else value.reward
    if isinstance(reward, (str, bytes)) or not hasattr(reward, "__float__"):
        raise TypeError(f"Environment.step's reward must be a number, got {type(reward).__name__}")
    try:
        reward = float(reward)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a tensor of several elements
        raise TypeError(f"Environment.step's reward must be a number: {exc}") from None
    if not math.isfinite(reward):  # an inf or NaN would turn its group's advantages into NaN
        raise ValueError(f"Environment.step's reward must be finite, got {reward}")
    try:
        done = bool(value.done)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"Environment.step's done must be a bool: {exc}") from None
    return StepResult(value.observation, reward, done)


def _brief(message: dict) -> str:
    text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


class ToolEnvironment:
    """The "tools" environment: each turn's tool calls run concurrently, results come back as tool
    messages; a turn that makes no call ends the episode (its text is the final answer)."""

    def __init__(self, tools: dict[str, Tool], parser: ToolCallParser, timeout_s: float,
                 limit: asyncio.Semaphore | None = None, stuck_limit: int = STUCK_PER_PARALLEL_CALL * 16):
        self.tools, self.parser, self.timeout_s, self.limit = tools, parser, timeout_s, limit
        self.stuck_limit = stuck_limit

    async def astep(self, action_text: str, stats: StepStats, time_left: float,
                    last_turn: bool) -> StepResult:
        parsed = parse_safely(self.parser, action_text)
        if not parsed.has_calls:
            return StepResult(None, 0.0, True)
        if last_turn:  # no turn left to read the results: do not run the tools
            return StepResult(None, 0.0, False)
        results = [error_result("", "malformed", e) for e in parsed.errors]
        results += await run_calls(parsed.calls, self.tools, min(self.timeout_s, time_left), self.limit,
                                   self.stuck_limit)
        stats.tool_calls += len(parsed.calls) + len(parsed.errors)
        for r in results:
            stats.tool_seconds += r.seconds
            if r.error:
                stats.tool_errors += 1
                stats.tool_timeouts += r.error == "timeout"
                stats.errors_by_kind[r.error] = stats.errors_by_kind.get(r.error, 0) + 1
        return StepResult([_tool_message(r) for r in results], 0.0, False)


def _tool_message(result) -> dict:
    message = {"role": "tool", "content": result.content}
    if result.name:
        message["name"] = result.name
    return message
