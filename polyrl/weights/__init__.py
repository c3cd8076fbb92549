"""Weight sync: moving new policy weights from the trainer to the rollout engines.

    in_place      hybrid placement: one engine.update_weights call in the trainer process
    broadcast     standalone: bucketed broadcast from the weight-sync group's leader, through
                  shared memory on one host (shm_broadcast.py) or the communication backend
                  (backend_broadcast.py), chosen once at the first transfer (broadcast.py)
    object_store  standalone fallback through Ray's object store

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
