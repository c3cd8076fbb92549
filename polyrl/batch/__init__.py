"""The step's data as typed tensors: `RolloutBatch` (columnar, ragged per-token fields) and the
`MicroBatch` a forward pass reads, padded (micro.py) or packed into one row (packed.py)."""

from polyrl.batch.micro import MicroBatch, collate, plan_micro_batches, scatter_rows
from polyrl.batch.ragged import Ragged
from polyrl.batch.rollout_batch import (AGENT_LIMITS, STOP_REASONS, AgentColumns, RolloutBatch, shard,
                                        split_evenly)

__all__ = ["AGENT_LIMITS", "AgentColumns", "MicroBatch", "Ragged", "RolloutBatch", "STOP_REASONS", "collate", "plan_micro_batches",
           "scatter_rows", "shard", "split_evenly"]
