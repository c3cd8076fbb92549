"""Colocated placement: the engine lives in the trainer's process, so "sending" is one
`engine.update_weights` call (the engine copies into its own layout, all or nothing).

The engine is handed the weight stream itself, not a dict of it: an engine that loads a stream
(the native engine checks every name and shape against the specs first, then copies each tensor
as it is gathered) never sees more than one tensor at a time, so an FSDP2 rank holds its shards,
the engine's copy and one gathered tensor.
"""

from __future__ import annotations

import time
from typing import Any

from polyrl.weights.base import NamedTensors, TransferStats, as_stream


class InPlaceTransport:
    name = "in_place"

    def __init__(self, config: Any = None, *, engine: Any):
        self.config, self.engine = config, engine

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        stream = as_stream(named_tensors)
        t0 = time.perf_counter()
        self.engine.update_weights(stream, version)
        seconds = time.perf_counter() - t0
        return TransferStats(self.name, version, len(stream), 1, stream.nbytes, seconds)

    def receive(self, engine: Any = None) -> int:
        """Nothing travels: the engine already serves what `send` applied."""
        return int((engine or self.engine).weight_version)
