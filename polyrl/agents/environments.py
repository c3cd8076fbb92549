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
an environment keeps its episode's state in `self`. The row chooses its environment through
`extra_info[agent.environment_key]` (default key "agent_name", verl's column name); rows without
it use `agent.environment`. An observation is a string (a user turn), one message dict, or a list
of them; it is appended through the chat template and masked out of the loss.

Tool use is the environment named "tools": `step` parses the turn's tool calls, runs them and
returns the results as tool messages; a turn without calls ends the episode.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Union

from polyrl.agents.executor import error_result, run_calls
from polyrl.agents.parsers import ToolCallParser
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


ENVIRONMENTS: Registry[type] = Registry("agent environment")


def as_messages(observation: Observation | None) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return list(observation)
    raise TypeError(f"an observation is a string, a message dict or a list of them, got {type(observation).__name__}")


def as_step_result(value: Any) -> StepResult:
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        return StepResult(value[0], float(value[1] or 0.0), bool(value[2]))
    raise TypeError(f"Environment.step must return StepResult or (observation, reward, done), got {value!r}")


class ToolEnvironment:
    """The "tools" environment: each turn's tool calls run concurrently, results come back as tool
    messages; a turn that makes no call ends the episode (its text is the final answer)."""

    def __init__(self, tools: dict[str, Tool], parser: ToolCallParser, timeout_s: float,
                 limit: asyncio.Semaphore | None = None):
        self.tools, self.parser, self.timeout_s, self.limit = tools, parser, timeout_s, limit

    async def astep(self, action_text: str, stats: StepStats, time_left: float,
                    last_turn: bool) -> StepResult:
        parsed = self.parser.parse(action_text)
        if not parsed.has_calls:
            return StepResult(None, 0.0, True)
        if last_turn:  # no turn left to read the results: do not run the tools
            return StepResult(None, 0.0, False)
        results = [error_result("", "malformed", e) for e in parsed.errors]
        results += await run_calls(parsed.calls, self.tools, min(self.timeout_s, time_left), self.limit)
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
