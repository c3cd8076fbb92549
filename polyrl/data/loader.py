"""Batches of prompts with a deterministic, resumable order.

The order of epoch e is a pure function of (seed, e): a permutation drawn from
numpy's PCG64 seeded with [seed, e]. The loader's whole state is therefore (epoch, position):
resuming from `state_dict()` - mid-epoch or exactly at an epoch boundary - yields the same
batches an uninterrupted run would have, with no RNG state to save.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from polyrl.config import ConfigError
from polyrl.data.dataset import PromptSample


class PromptLoader:
    def __init__(
        self,
        dataset: Sequence[PromptSample],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        name: str = "train",
    ):
        if batch_size < 1:
            raise ValueError(f"{name} batch size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        n = len(dataset)
        self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        if self.batches_per_epoch == 0:
            # a ConfigError: the CLI prints it as one line (exit 2), not a traceback
            raise ConfigError([
                f"data.{name}_batch_size={batch_size} is larger than the {name} set ({n} prompts "
                f"after filtering), so drop_last leaves no batch; lower data.{name}_batch_size "
                "or set data.drop_last=false"
            ])
        self.epoch = 0
        """Epoch the next batch comes from."""
        self.position = 0
        """Batches of `epoch` already handed out."""
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order of `epoch`."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)
            else:
                perm = np.arange(n)
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def _batch(self, epoch: int, position: int) -> list[PromptSample]:
        start = position * self.batch_size
        return [self.dataset[int(i)] for i in self.order(epoch)[start : start + self.batch_size]]

    def __iter__(self) -> Iterator[list[PromptSample]]:
        """The remaining batches of the current epoch; the epoch advances once they are used up.

        `for epoch in range(loader.epoch, total_epochs): for batch in loader: ...`
        """
        while self.position < self.batches_per_epoch:
            batch = self._batch(self.epoch, self.position)
            self.position += 1  # counted before the yield: a checkpoint taken now skips it
            yield batch
        self.epoch += 1
        self.position = 0

    def epoch_batches(self, epoch: int = 0) -> list[list[PromptSample]]:
        """Every batch of `epoch`, without moving the loader (validation reads its set this way)."""
        return [self._batch(epoch, i) for i in range(self.batches_per_epoch)]

    def next_batch(self) -> list[PromptSample]:
        """The next batch, crossing epoch boundaries (for step-counted training loops)."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        batch = self._batch(self.epoch, self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_size": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "dataset_size", "batch_size"):
            mine = getattr(self, key) if key != "dataset_size" else len(self.dataset)
            if state.get(key, mine) != mine:
                raise ValueError(
                    f"cannot resume the data loader: the checkpoint has {key}={state[key]} but "
                    f"this run has {key}={mine}; resume with the same data and data config"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if position >= self.batches_per_epoch:  # saved right after an epoch's last batch
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position
