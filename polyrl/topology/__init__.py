"""Rollout topologies: how rollout is placed and timed relative to training (base.py).

    colocated      rollout.placement=colocated                          colocated.py
    disaggregated  rollout.placement=disaggregated, trainer.mode=sync   disaggregated.py
    streaming      rollout.placement=disaggregated, trainer.mode=async  streaming.py

What each one is (its engine, actors, transports, staleness) is data in polyrl/distributed/topologies.py, which is also
the one place that maps the config onto a topology (`topology_of`); `build_topology` builds the
class of that name. Adding one (e.g. colocated one-step-off async) is one module, one spec and
one entry in TOPOLOGIES.

The package imports nothing heavy: config.py is a leaf the job schema reads, so the topology
classes (Ray, the workers) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyrl.registry import Registry
from polyrl.distributed.topologies import TOPOLOGY_SPECS, TopologySpec, topology_of

if TYPE_CHECKING:
    from polyrl.topology.base import Scorer, Topology, TopologyContext, TrainingError

TOPOLOGIES: Registry[type] = Registry("rollout topology")
TOPOLOGIES.register("colocated", "polyrl.topology.colocated:ColocatedTopology")
TOPOLOGIES.register("disaggregated", "polyrl.topology.disaggregated:DisaggregatedTopology")
TOPOLOGIES.register("streaming", "polyrl.topology.streaming:StreamingTopology")

_FROM_BASE = ("Scorer", "Topology", "TopologyContext", "TrainingError")


def topology_name(cfg: Any) -> str:
    return topology_of(cfg).name


def build_topology(ctx: "TopologyContext") -> "Topology":
    return TOPOLOGIES.get(topology_name(ctx.cfg))(ctx)


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:  # on first use: base.py imports Ray and the workers
        from polyrl.topology import base

        return getattr(base, name)
    raise AttributeError(f"module 'polyrl.topology' has no attribute '{name}'")


__all__ = ["Scorer", "TOPOLOGIES", "TOPOLOGY_SPECS", "Topology", "TopologyContext", "TopologySpec",
           "TrainingError", "build_topology", "topology_name", "topology_of"]
