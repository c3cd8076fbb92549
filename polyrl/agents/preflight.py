"""Pre-flight check of an agent config: its tools, its black-box agent and the environments its
rows name, before Ray starts.

The rollout workers load `agent.tools` and `agent.black_box` themselves and look environments up
by name per row; without this check a typo, a missing file, a module that raises on import, a tool
whose type hints have no JSON schema or an unregistered environment surfaces only after Ray and
the actors started, as a remote traceback. Here each is one line naming the key (the trainer's
pre-flight, polyrl/trainer/preflight.py, calls it).
"""

from __future__ import annotations

from typing import Any, Iterable

from polyrl.agents.config import AgentConfig
from polyrl.config import ConfigError


def check_agent(cfg: AgentConfig, *datasets: Iterable[Any] | None) -> None:
    """Import every tool (building its schema) and the black-box agent, and check that the
    environment every row of `datasets` names (data rows with `extra_info`; None: no dataset) is
    registered; raises `ConfigError` with one line at the first problem."""
    from polyrl.agents.black_box import load_agent
    from polyrl.agents.tools import load_tools

    try:
        load_tools(cfg.tools)
        if cfg.black_box is not None:
            load_agent(cfg.black_box)
    except ValueError as exc:  # both loaders' messages name the key and the spec
        raise ConfigError([(str(exc).strip().splitlines() or [""])[0]]) from None
    check_environments(cfg, (row for rows in datasets if rows is not None for row in rows))


def check_environments(cfg: AgentConfig, rows: Iterable[Any] = ()) -> None:
    """`agent.environment` and each row's `extra_info[agent.environment_key]` name "tools" or an
    environment registered in polyrl.agents.ENVIRONMENTS (only where the agent loop runs)."""
    from polyrl.agents.environments import ENVIRONMENTS

    if not cfg.enabled or cfg.black_box is not None:  # rows' environment names are not read
        return
    known = lambda name: name == "tools" or name in ENVIRONMENTS  # noqa: E731
    choices = ", ".join(["tools", *ENVIRONMENTS.names()])
    if cfg.environment is not None and not known(cfg.environment):
        raise ConfigError([f"agent.environment={cfg.environment} is not a registered environment; "
                           f"registered: {choices} (register yours in polyrl.agents.ENVIRONMENTS)"])
    for row in rows:
        name = (getattr(row, "extra_info", None) or {}).get(cfg.environment_key)
        if name and not known(name):
            raise ConfigError([f"data row {getattr(row, 'index', '?')} names the environment '{name}' in "
                               f"extra_info.{cfg.environment_key} (agent.environment_key), which is not "
                               f"registered; registered: {choices}"])
