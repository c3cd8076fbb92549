"""Weight sync: moving new policy weights from the trainer to the rollout engines.

    in_place      colocated: one engine.update_weights call in the trainer process
    broadcast     disaggregated: bucketed broadcast from the weight-sync group's leader, through
                  shared memory on one host (shm_broadcast.py) or the communication backend
                  (backend_broadcast.py), chosen once at the first transfer (broadcast.py)
    object_store  streaming (its only one), or disaggregated: through Ray's object store

Which topology allows which, and which is `weights.transport=auto`, is the topology table's
(polyrl/distributed/topologies.py); an actor opens the one its `RolePlan` names.

All three are version-stamped and applied all or nothing (see `base.py`).
"""

from polyrl.weights.base import (
    WEIGHT_TRANSPORTS,
    TransferStats,
    WeightSyncError,
    WeightTransport,
    build_transport,
)
from polyrl.weights.config import WeightSyncConfig

__all__ = [
    "WEIGHT_TRANSPORTS",
    "TransferStats",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightTransport",
    "build_transport",
]
