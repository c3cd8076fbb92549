"""Agentic RL: multi-turn rollouts with tools and environments, token-exact by construction.

    from polyrl.agents import AgentConfig, run_trajectories_sync
    rollout = run_trajectories_sync(engine, tokenizer, rows, sampling, AgentConfig(tools=[...]))

See docs/agents.md. Modules: tools (typed functions -> JSON schema), parsers (tool-call formats),
executor (concurrent calls with timeouts), chat (template deltas), environments (registry),
runner (the turn loop), stats (trajectories -> RolloutBatch and metrics), black_box (any OpenAI-API
agent program, trained on the ids the server sampled).
"""

from polyrl.agents.config import AgentConfig
from polyrl.agents.environments import ENVIRONMENTS, Environment, StepResult
from polyrl.agents.parsers import TOOL_PARSERS, HermesParser, ParsedTurn, ToolCall
from polyrl.agents.runner import AgentRunner, run_trajectories, run_trajectories_sync
from polyrl.agents.stats import AgentRollout, Trajectory, TrajectoryStats
from polyrl.agents.tools import Tool, load_tools

__all__ = [
    "AgentConfig", "AgentRollout", "AgentRunner", "ENVIRONMENTS", "Environment", "HermesParser",
    "ParsedTurn", "StepResult", "TOOL_PARSERS", "Tool", "ToolCall", "Trajectory", "TrajectoryStats",
    "load_tools", "run_trajectories", "run_trajectories_sync",
]
