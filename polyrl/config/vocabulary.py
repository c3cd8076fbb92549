"""The one set of names for where an engine lives (docs/architecture.md, "Vocabulary").

A placement says where a rollout engine (`rollout.placement`) or a distillation teacher
(`distill.placement`) lives: `colocated` on the trainer's devices (weights updated in place),
or `disaggregated` on devices of its own. A topology (polyrl/distributed/topologies.py) is a
placement x a trainer mode; a weight transport (polyrl/weights/) says how weights move, not
where the engine is. Earlier spellings of the config values stay accepted as aliases: the config
models normalize them before validation (`canonical_placement`), so the resolved config, the
dry run and every plan show the names below. It sits in the config layer so that the config
models, the environment rules and the topology table read the same constants.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

COLOCATED = "colocated"
"""The engine shares the trainer's devices (and its process): weights are updated in place."""
DISAGGREGATED = "disaggregated"
"""The engine runs on devices (and in processes) of its own: weights are sent to it."""
PLACEMENTS = (COLOCATED, DISAGGREGATED)

PLACEMENT_ALIASES: dict[str, dict[str, str]] = {
    "rollout.placement": {"hybrid": COLOCATED, "standalone": DISAGGREGATED},
    "distill.placement": {"standalone": DISAGGREGATED},
}
"""Earlier config values, per key, and the name each is now called."""

_announced: set[tuple[str, str]] = set()


def canonical_placement(value: object, key: str) -> object:
    """`value` of config key `key` with an earlier spelling replaced by its name; logs one line
    the first time each alias is used. Anything else is returned as given (the field's own
    validation names the valid values)."""
    aliases = PLACEMENT_ALIASES.get(key, {})
    if not isinstance(value, str) or value not in aliases:
        return value
    name = aliases[value]
    if (key, value) not in _announced:
        _announced.add((key, value))
        logger.warning("%s=%s is now called %s", key, value, name)
    return name


def with_names(config: dict) -> dict:
    """A nested config dict (a saved config.yaml) with every earlier placement value replaced by
    its name, so a run written before the rename compares equal to the same run now."""
    out = dict(config)
    for key in PLACEMENT_ALIASES:
        section, field = key.split(".")
        if isinstance(out.get(section), dict) and field in out[section]:
            out[section] = {**out[section], field: canonical_placement(out[section][field], key)}
    return out
