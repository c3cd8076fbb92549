"""What the launch plan passes as `colocated` for a config (the topology's decision,
polyrl/distributed/topologies.py): the launch-argument builders take it, they never read
`rollout.placement` themselves."""

from polyrl.distributed.topologies import select_topology


def colocated(rollout) -> bool:
    return select_topology(rollout.placement).colocated_engine
