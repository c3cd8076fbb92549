"""`AgentConfig`: tools, the tool-call format, the environment per row, a black-box agent, and the
limits of a multi-turn trajectory (each limit counted in the agent metrics when it ends a trajectory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from polyrl.config import Config
from polyrl.config.targets import IMPORT_PATH_FORMS, is_file_target, split_import_path


INTEGRATION_PREFIXES = ("openenv:", "verifiers:")
"""`agent.environment` values served by an integration rather than imported (docs/agents.md)."""


class AgentConfig(Config):
    tools: list[str] = Field(default_factory=list)
    """Tool functions as "package.module:function" or "/path/to/file.py:function", or the name of
    one a package registers in the polyrl.tools entry-point group; the JSON schema each model
    sees comes from the function's type hints and docstring (polyrl/agents/tools.py,
    docs/plugins.md)."""

    mcp_servers: list[str] = Field(default_factory=list)
    """MCP tool servers whose tools join `tools` (pip install 'polyrl[mcp]'): each a stdio
    command line ("python server.py") or an http(s):// URL of a Streamable HTTP server. Each is
    started once per rollout worker and kept for the run (polyrl/agents/mcp_tools.py); a tool
    error or a dead server is an "Error: ..." tool result (docs/integrations.md)."""

    mcp_start_timeout_s: float = Field(60.0, gt=0)
    """Most seconds an MCP server may take to start and list its tools."""

    tool_parser: str = "hermes"
    """How tool calls are written: hermes (= qwen: <tool_call>{"name", "arguments"}</tool_call>)."""

    tools_in_prompt: bool = True
    """Render the tool schemas into the first prompt through the chat template's `tools` argument
    (chat-message prompts only). Off for a model warm-started to know its tools."""

    environment: str | None = None
    """Environment for rows that do not name one; null: "tools" when tools are set, else a single
    turn. Built-in: tools; others are registered in polyrl.agents.ENVIRONMENTS or the
    polyrl.environments entry-point group, or named by import path as
    "package.module:MyEnv" or "/path/to/file.py:MyEnv" (docs/plugins.md), or an OpenEnv server as
    "openenv:http://HOST:PORT" or "openenv:package.module[:app]" (docs/agents.md)."""

    environment_key: str = "agent_name"
    """The row's extra_info key that names its environment (verl's agent_name column)."""

    per_row_environments: bool = False
    """Run the agent loop even without a default environment, so rows can name theirs in
    extra_info[environment_key] (rows naming none get a single turn)."""

    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for every environment instance (for verifiers:..., the rest of its env
    config: docs/agents.md)."""

    max_turns: int = Field(4, ge=1)
    """Assistant turns per trajectory; a trajectory still calling tools at the last one ends
    there (agent/limit_turns)."""

    max_response_tokens: int = Field(512, ge=1)
    """Response tokens per trajectory, sampled and tool / environment ones together
    (agent/limit_response_tokens)."""

    tool_timeout_s: float = Field(10.0, gt=0)
    """Most seconds one tool call (or environment step) may run; a slower one becomes an error
    message to the model (agent/tool_timeouts)."""

    max_tool_seconds: float = Field(60.0, gt=0)
    """Tool and environment seconds per trajectory; the trajectory ends once they are spent
    (agent/limit_tool_seconds)."""

    max_parallel_tools: int = Field(16, ge=1)
    """Tool calls running at once across all trajectories of a batch. Calls abandoned on their
    timeout keep their thread until they return; once 4x this many are still running, further
    calls are not started (each an "Error: ... was not run" timeout) until one returns."""

    lockstep_turns: bool = True
    """Start every trajectory's next engine turn together, once all of the batch's previous turns
    and their tool / environment steps are done: the engine then batches the same sequences
    whatever the tools' timing, so same-seed runs are bit-identical. False: each trajectory goes
    on as soon as its tools return (less idle time with slow tools, timing-dependent log-probs)."""

    black_box: str | None = None
    """A black-box agent as "package.module:function" or "/path/to/file.py:function" (importable
    by every rollout worker): called once per sample as
    `agent(base_url, row, trajectory_id)` (sync or async) while polyrl serves the rollout engine
    over the OpenAI API at `base_url`; it returns None (the reward function scores the last
    turn), a number (the reward) or a string (the final answer to score). The trainer learns from
    the ids the server sampled (docs/agents.md, black-box agents)."""

    black_box_timeout_s: float = Field(600.0, gt=0)
    """Most seconds one black-box agent run may take; a slower one is abandoned and counted in
    agent/env_errors (its trajectory gets no loss)."""

    max_parallel_agents: int = Field(64, ge=1)
    """Black-box agent runs at once per rollout call (a rollout worker's batch; an async replica
    serving several calls at once runs up to this many per call)."""

    @model_validator(mode="before")
    @classmethod
    def _verifiers_as_black_box(cls, data: Any) -> Any:
        """A verifiers environment runs as a black-box agent against polyrl's endpoint
        (polyrl/agents/verifiers_env.py): `environment: verifiers:X` becomes `black_box`."""
        if isinstance(data, dict) and str(data.get("environment") or "").startswith("verifiers:"):
            if data.get("black_box") is not None:
                raise ValueError("agent.environment=verifiers:... runs as the black-box agent: unset agent.black_box")
            data = {**data, "black_box": data["environment"], "environment": None}
        return data

    @model_validator(mode="after")
    def _check(self) -> "AgentConfig":
        from polyrl.agents.parsers import TOOL_PARSERS

        if self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser '{self.tool_parser}' is not one of {', '.join(TOOL_PARSERS.names())}")
        for spec in self.tools:
            if ":" not in spec and spec.isidentifier():  # a registered tool's name
                continue
            target = split_import_path(spec)[0]
            if not target:
                raise ValueError(f"tool '{spec}' must look like package.module:function or /path/to/file.py:function "
                                 "(or name a tool registered in the polyrl.tools entry-point group)")
            if is_file_target(target) and not Path(target).expanduser().is_file():
                raise ValueError(f"agent.tools: file {target} does not exist")
        for spec in self.mcp_servers:
            from polyrl.agents.mcp_tools import spec_problem

            problem = spec_problem(spec)
            if problem:
                raise ValueError(f"agent.mcp_servers: '{spec}' {problem}")
        if self.environment is not None and ":" in self.environment and not self.environment.startswith(
                INTEGRATION_PREFIXES):
            target = split_import_path(self.environment)[0]
            if not target:
                raise ValueError(f"agent.environment '{self.environment}' must be a registered name or "
                                 f"{IMPORT_PATH_FORMS.replace('name', 'MyEnv')}")
            if is_file_target(target) and not Path(target).expanduser().is_file():
                raise ValueError(f"agent.environment: file {target} does not exist")
        if self.black_box is not None:
            target = self.black_box.rpartition(":")[0]
            if not target:
                raise ValueError(f"agent.black_box '{self.black_box}' must look like package.module:function "
                                 "or /path/to/file.py:function")
            if is_file_target(target) and not Path(target).expanduser().is_file():
                raise ValueError(f"agent.black_box: file {target} does not exist")
            if self.tools or self.mcp_servers or self.environment is not None or self.per_row_environments:
                raise ValueError("agent.black_box runs its own agent loop: unset agent.tools, agent.mcp_servers, agent.environment "
                                 "and agent.per_row_environments (the agent calls its tools itself)")
        return self

    @property
    def plugin_specs(self) -> list[str]:
        """The keys naming a user's code by import path: the environment, the tools, the
        black-box agent (their directories must reach every Ray worker:
        polyrl/envplan/code_paths.py)."""
        specs = [self.environment, *self.tools, self.black_box]
        return [s for s in specs
                if s is not None and split_import_path(s)[0] and not s.startswith(INTEGRATION_PREFIXES)]

    @property
    def enabled(self) -> bool:
        """Whether rollouts go through the multi-turn agent loop."""
        return self.default_environment is not None or self.per_row_environments or self.black_box is not None

    @property
    def default_environment(self) -> str | None:
        if self.environment is not None:
            return self.environment
        return "tools" if self.tools or self.mcp_servers else None
