"""Rollout topologies: how rollout is placed and timed relative to training (base.py).

    colocated      rollout.placement=hybrid
    disaggregated  rollout.placement=standalone, trainer.mode=sync
    streaming      rollout.placement=standalone, trainer.mode=async

`build_topology` is the one place that maps the config onto a topology; adding one (e.g.
colocated one-step-off async) is one module plus one entry in TOPOLOGIES.
"""

from __future__ import annotations


from polyrl.registry import Registry
from polyrl.topology.base import Scorer, Topology, TopologyContext, TrainingError
from polyrl.job import JobConfig

TOPOLOGIES: Registry[type] = Registry("rollout topology")
TOPOLOGIES.register("colocated", "polyrl.topology.colocated:ColocatedTopology")
TOPOLOGIES.register("disaggregated", "polyrl.topology.disaggregated:DisaggregatedTopology")
TOPOLOGIES.register("streaming", "polyrl.topology.streaming:StreamingTopology")


def topology_name(cfg: JobConfig) -> str:
    if cfg.rollout.placement == "hybrid":
        return "colocated"
    return "streaming" if cfg.trainer.mode == "async" else "disaggregated"


def build_topology(ctx: TopologyContext) -> Topology:
    return TOPOLOGIES.get(topology_name(ctx.cfg))(ctx)


__all__ = ["Scorer", "TOPOLOGIES", "Topology", "TopologyContext", "TrainingError", "build_topology",
           "topology_name"]
