"""Pre-flight check of an agent config: its tools and its black-box agent import, before Ray starts.

The rollout workers load `agent.tools` and `agent.black_box` themselves; without this check a
typo, a missing file, a module that raises on import or a tool whose type hints have no JSON
schema surfaces only after Ray and the actors started, as a remote traceback. Here each is one
line naming the key (the trainer's pre-flight, polyrl/trainer/preflight.py, calls it).
"""

from __future__ import annotations

from polyrl.agents.config import AgentConfig
from polyrl.config import ConfigError


def check_agent(cfg: AgentConfig) -> None:
    """Import every tool (building its schema) and the black-box agent; raises `ConfigError`
    with one line at the first that fails."""
    from polyrl.agents.black_box import load_agent
    from polyrl.agents.tools import load_tools

    try:
        load_tools(cfg.tools)
        if cfg.black_box is not None:
            load_agent(cfg.black_box)
    except ValueError as exc:  # both loaders' messages name the key and the spec
        raise ConfigError([(str(exc).strip().splitlines() or [""])[0]]) from None
