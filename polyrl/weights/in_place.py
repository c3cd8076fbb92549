"""Hybrid placement: the engine lives in the trainer's process, so "sending" is one
`engine.update_weights` call (the engine copies into its own layout, all or nothing)."""

from __future__ import annotations

import time
from typing import Any

from polyrl.weights.base import NamedTensors, TransferStats, named_items


class InPlaceTransport:
    name = "in_place"

    def __init__(self, config: Any = None, *, engine: Any):
        self.config, self.engine = config, engine

    def send(self, named_tensors: NamedTensors, version: int) -> TransferStats:
        items = named_items(named_tensors)
        t0 = time.perf_counter()
        self.engine.update_weights(dict(items), version)
        seconds = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        return TransferStats(self.name, version, len(items), 1, nbytes, seconds)

    def receive(self, engine: Any = None) -> int:
        """Nothing travels: the engine already serves what `send` applied."""
        return int((engine or self.engine).weight_version)
