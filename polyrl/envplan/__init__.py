"""The environment plan: every environment variable polyrl gives any process, with provenance.

The only module that computes or writes environment for other processes (R1, R2, R3 in docs/architecture.md).
"""

from polyrl.envplan.plan import (
    BACKENDS,
    MODES,
    PLACEMENTS,
    ROLES,
    EnvEntry,
    EnvPlan,
    PlanContext,
    build_plan,
)
from polyrl.envplan.rules import RULES, EnvRule

__all__ = [
    "BACKENDS",
    "MODES",
    "PLACEMENTS",
    "ROLES",
    "RULES",
    "EnvEntry",
    "EnvPlan",
    "EnvRule",
    "PlanContext",
    "build_plan",
]
