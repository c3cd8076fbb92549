"""A trajectory's ids, masks and counters, and how a batch of them becomes a `RolloutBatch`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.agents.environments import StepStats
from polyrl.batch import STOP_REASONS, Ragged, RolloutBatch
from polyrl.batch.routes import encode, routes_column
from polyrl.rollout.base import TokenOutput


@dataclass
class TrajectoryStats:
    environment: str | None = None
    turns: int = 0
    """Assistant turns the engine generated."""
    tool_calls: int = 0
    """Calls the model made, malformed ones included."""
    tool_errors: int = 0
    """Calls that came back as an error message (malformed, unknown tool, bad arguments, raised,
    timed out)."""
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    """Seconds spent in tools and environment steps."""
    env_errors: int = 0
    """Environment calls that raised, timed out or returned something unusable: the constructor,
    reset or a step (each ends its trajectory), or close (counted only)."""
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    turn_rewards: list[float] = field(default_factory=list)
    """The environment's reward after each of its steps."""
    limit: str | None = None
    """The limit that ended the trajectory: turns | response_tokens | tool_seconds | context."""
    reward: float | None = None
    """A reward for the whole trajectory (what a black-box agent returned), else None."""
    prefix_mismatch: int = 0
    """1 when a black-box agent's later prompt did not extend its earlier prompt + sampled ids
    (the trajectory gets no loss)."""
    reward_terms: dict[str, float] = field(default_factory=dict)
    """The named terms a black-box agent returned, whose sum is `reward` (reward/<name>)."""

    def add(self, step: StepStats, reward: float) -> None:
        self.tool_calls += step.tool_calls
        self.tool_errors += step.tool_errors
        self.tool_timeouts += step.tool_timeouts
        self.tool_seconds += step.tool_seconds
        self.add_errors(step.errors_by_kind)
        self.turn_rewards.append(float(reward))

    def add_errors(self, errors: dict[str, int]) -> None:
        """Count errors by kind; environment ones ("env_...") also in env_errors."""
        for kind, n in errors.items():
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + n
            if kind.startswith("env_"):
                self.env_errors += n

    @property
    def env_reward(self) -> float | None:
        """A black-box agent's reward, else the sum of the environment's rewards (None for
        tools-only or single-turn trajectories)."""
        if self.reward is not None:
            return self.reward
        if self.environment in (None, "tools", "black_box"):
            return None
        return float(sum(self.turn_rewards))


@dataclass
class Trajectory:
    prompt_ids: list[int]
    group: int
    stats: TrajectoryStats
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """Every turn after the prompt with its role (the samples log)."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each assistant turn inside response_ids."""
    routes: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    """A mixture-of-experts engine's routes, piece by piece along response_ids: (tokens, the
    engine's [tokens, layers, k] of an assistant turn, or None where the trainer routes: tool /
    environment turns, an engine that records none; polyrl/batch/routes.py)."""
    final_text: str = ""
    stop_reason: str = "stop"
    weight_version: int = 0
    min_version: int | None = None
    max_version: int | None = None
    row: Any = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_turn(self, out: TokenOutput, tokenizer: Any) -> None:
        start = len(self.response_ids)
        self.response_ids += out.token_ids
        self.loss_mask += [1.0] * len(out.token_ids)
        logprobs = list(out.logprobs) if len(out.logprobs) == len(out.token_ids) else [0.0] * len(out.token_ids)
        self.logprobs += logprobs
        routes = out.extra.get("routed_experts")
        self.routes.append((len(out.token_ids), routes if routes is not None and len(routes) == len(out.token_ids)
                            else None))
        self.turn_spans.append((start, len(self.response_ids)))
        text = out.text if out.text is not None else tokenizer.decode(out.token_ids, skip_special_tokens=True)
        self.final_text, self.stop_reason = text, out.stop_reason
        self.messages.append({"role": "assistant", "content": text})
        self.weight_version = out.weight_version
        lo = out.extra.get("min_weight_version", out.weight_version)
        hi = out.extra.get("max_weight_version", out.weight_version)
        self.min_version = lo if self.min_version is None else min(self.min_version, lo)
        self.max_version = hi if self.max_version is None else max(self.max_version, hi)

    def add_observation(self, ids: list[int], messages: list[dict]) -> None:
        self.response_ids += ids
        self.loss_mask += [0.0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.routes.append((len(ids), None))
        self.messages += messages


def to_rollout_batch(trajectories: list[Trajectory], eos: frozenset[int]) -> RolloutBatch:
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    response_ids = Ragged.from_rows([t.response_ids for t in trajectories], torch.long)
    return RolloutBatch(
        prompt_ids=Ragged.from_rows([t.prompt_ids for t in trajectories], torch.long),
        response_ids=response_ids,
        loss_mask=Ragged.from_rows([t.loss_mask for t in trajectories], torch.float32),
        group=long([t.group for t in trajectories]),
        stop_reason=long([STOP_REASONS.index(t.stop_reason) for t in trajectories]),
        # the *last* turn ended the episode on its own (the reward judges the final answer)
        finished_with_eos=torch.tensor([_ended_with_eos(t, eos) for t in trajectories], dtype=torch.bool),
        weight_version=long([t.weight_version for t in trajectories]),
        min_version=long([t.min_version or 0 for t in trajectories]),
        max_version=long([t.max_version or 0 for t in trajectories]),
        continuations=long([0] * len(trajectories)),
        rollout_logprobs=Ragged.from_rows([t.logprobs for t in trajectories], torch.float32),
        texts=[t.final_text for t in trajectories],
        prompts=[t.row for t in trajectories],
        routes=_routes(trajectories),
    )


def _routes(trajectories: list[Trajectory]) -> Ragged | None:
    """The batch's routes column (polyrl/batch/routes.py): each assistant turn's tokens as the
    engine routed them (its last token, fed only by the next turn's prefill, unmarked), every
    tool / environment token unmarked (the trainer routes it); None if no turn has routes."""
    first = next((r for t in trajectories for _, r in t.routes if r is not None), None)
    if first is None:
        return None
    dtype, (_, layers, k) = first.dtype, first.shape
    rows = [torch.cat([r if r is not None else encode(None, n, dtype, layers, k) for n, r in t.routes]
                      or [encode(None, 0, dtype, layers, k)])
            for t in trajectories]
    return routes_column([r if len(r) == len(t.response_ids) else encode(None, len(t.response_ids), dtype, layers, k)
                          for r, t in zip(rows, trajectories)])


def _ended_with_eos(t: Trajectory, eos: frozenset[int]) -> bool:
    """The *last* assistant turn ended on EOS: the model gave its final answer on its own."""
    if t.stop_reason != "stop" or not t.turn_spans:
        return False
    start, end = t.turn_spans[-1]
    return end > start and t.response_ids[end - 1] in eos


@dataclass
class AgentRollout:
    batch: RolloutBatch
    trajectories: list[Trajectory]

    @property
    def stats(self) -> list[TrajectoryStats]:
        return [t.stats for t in self.trajectories]

    @property
    def env_rewards(self) -> torch.Tensor:
        """[N] float32: the environment's reward per trajectory, NaN where none gave one."""
        return torch.tensor([math.nan if s.env_reward is None else s.env_reward for s in self.stats],
                            dtype=torch.float32)

    @property
    def reward_terms(self) -> dict[str, torch.Tensor]:
        """[N] float32 per named reward term, NaN where a trajectory has none."""
        names = sorted({k for s in self.stats for k in s.reward_terms})
        return {k: torch.tensor([s.reward_terms.get(k, math.nan) for s in self.stats], dtype=torch.float32)
                for k in names}

    @property
    def transcripts(self) -> list[list[dict]]:
        return [t.messages for t in self.trajectories]

    def metrics(self) -> dict[str, float]:
        stats, n = self.stats, max(len(self.stats), 1)
        out = {
            "agent/turns_mean": sum(s.turns for s in stats) / n,
            "agent/tool_calls_mean": sum(s.tool_calls for s in stats) / n,
            "agent/tool_errors": float(sum(s.tool_errors for s in stats)),
            "agent/tool_timeouts": float(sum(s.tool_timeouts for s in stats)),
            "agent/tool_seconds": float(sum(s.tool_seconds for s in stats)),
            "agent/env_errors": float(sum(s.env_errors for s in stats)),
            "agent/prefix_mismatch": float(sum(s.prefix_mismatch for s in stats)),
        }
        for limit in ("turns", "response_tokens", "tool_seconds", "context"):
            out[f"agent/limit_{limit}"] = float(sum(s.limit == limit for s in stats))
        rewards = [s.env_reward for s in stats if s.env_reward is not None]
        if rewards:
            out["agent/env_reward_mean"] = sum(rewards) / len(rewards)
        for name in sorted({k for s in stats for k in s.reward_terms}):
            values = [s.reward_terms[name] for s in stats if name in s.reward_terms]
            out[f"reward/{name}"] = sum(values) / len(values)
        return out
