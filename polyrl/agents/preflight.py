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
        if cfg.mcp_servers:  # started and stopped here; each rollout worker starts its own
            from polyrl.agents.mcp_tools import check_servers

            check_servers(cfg.mcp_servers, cfg.mcp_start_timeout_s)
        if cfg.black_box is not None:
            load_agent(cfg.black_box, cfg.environment_kwargs)
    except ValueError as exc:  # both loaders' messages name the key and the spec
        raise ConfigError([(str(exc).strip().splitlines() or [""])[0]]) from None
    check_environments(cfg, (row for rows in datasets if rows is not None for row in rows))


def check_environments(cfg: AgentConfig, rows: Iterable[Any] = ()) -> None:
    """`agent.environment` and each row's `extra_info[agent.environment_key]` name "tools", an
    environment registered in polyrl.agents.ENVIRONMENTS (or its entry-point group), or a class
    by import path that imports here (only where the agent loop runs)."""
    if not cfg.enabled or cfg.black_box is not None:  # rows' environment names are not read
        return
    if cfg.environment is not None:
        problem = environment_problem(cfg.environment)
        if problem:
            raise ConfigError([f"agent.environment={cfg.environment} {problem}"])
    seen: set[str] = set()
    for row in rows:
        name = (getattr(row, "extra_info", None) or {}).get(cfg.environment_key)
        if not name or name in seen:
            continue
        seen.add(name)
        problem = environment_problem(name)
        if problem:
            raise ConfigError([f"data row {getattr(row, 'index', '?')} names the environment '{name}' in "
                               f"extra_info.{cfg.environment_key} (agent.environment_key), which {problem}"])


def environment_problem(name: str) -> str | None:
    """Why `name` cannot be built as an environment ("is not ...", one line), or None."""
    from polyrl.agents.environments import ENVIRONMENTS
    from polyrl.config.targets import is_import_path
    from polyrl.registry import RegistryError

    if name == "tools":
        return None
    if name.startswith("openenv:"):  # checked here without starting its server (that is per worker)
        from polyrl.agents.openenv_env import PREFIX, target_problem

        return target_problem(name[len(PREFIX):])
    try:
        factory = ENVIRONMENTS.get(name)
    except RegistryError as exc:
        if name in ENVIRONMENTS or is_import_path(name):  # registered or an import path: it failed to load
            return f"is not loadable: {exc}"
        return (f"is not a registered environment; registered: tools, "
                f"{'' if ENVIRONMENTS.names() else 'or '}{ENVIRONMENTS.choices()} "
                "(docs/plugins.md)")
    except Exception as exc:  # noqa: BLE001 - an entry point's module failed to import
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"is not loadable: importing it raised {type(exc).__name__}: {first}"
    if not callable(factory):
        return f"is not an environment class but a {type(factory).__name__} (docs/plugins.md)"
    return None
