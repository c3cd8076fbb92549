"""Variable-length rows stored as one flat tensor plus offsets.

Responses of one batch differ in length by 10-100x in RL. A padded `[N, max_len]` tensor spends
memory and pickling on padding; a list of Python lists costs one boxed object per token when it
crosses Ray (512 samples x 4k tokens = 2M boxed floats per field). `Ragged` keeps every token once,
in one contiguous tensor, which is also the packed (varlen) layout a packed forward consumes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Ragged:
    values: torch.Tensor
    """[T] every row's entries back to back."""
    offsets: torch.Tensor
    """[N + 1] int64: row i is values[offsets[i]:offsets[i + 1]]."""

    def __reduce__(self):
        # as numpy arrays: Ray's serializer moves those out of band (zero-copy from its object
        # store), where a torch tensor is pickled in band (copied into the pickle stream)
        return _from_numpy, (self.values.numpy(), self.offsets.numpy())

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float] | torch.Tensor], dtype: torch.dtype) -> Ragged:
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if rows and isinstance(rows[0], torch.Tensor):
            values = torch.cat([r.to(dtype).reshape(-1) for r in rows]) if rows else torch.zeros(0, dtype=dtype)
        else:
            values = torch.tensor([v for r in rows for v in r], dtype=dtype)
        return cls(values, offsets)

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor) -> Ragged:
        """Row i is padded[i, :lengths[i]]."""
        lengths = lengths.to(torch.long)
        width = padded.shape[1] if padded.dim() > 1 else 0
        keep = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(padded[keep].contiguous(), offsets)

    @classmethod
    def full_like(cls, other: Ragged, value: float, dtype: torch.dtype) -> Ragged:
        return cls(torch.full_like(other.values, value, dtype=dtype), other.offsets.clone())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        return self.values[self.offsets[i]: self.offsets[i + 1]]

    def tolist(self) -> list[list]:
        flat, ends = self.values.tolist(), self.offsets.tolist()
        return [flat[ends[i]: ends[i + 1]] for i in range(len(self))]

    def with_values(self, values: torch.Tensor) -> Ragged:
        """The same rows with other per-entry values (e.g. log-probs of these tokens)."""
        if values.shape[0] != self.values.shape[0]:
            raise ValueError(f"{values.shape[0]} values for {self.values.shape[0]} entries")
        return Ragged(values, self.offsets)

    def select(self, indices: Sequence[int] | torch.Tensor) -> Ragged:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if len(idx) and bool((idx[1:] - idx[:-1] == 1).all()):  # a contiguous run: a slice
            first, last = int(idx[0]), int(idx[-1]) + 1
            lo, hi = int(self.offsets[first]), int(self.offsets[last])
            return Ragged(self.values[lo:hi], self.offsets[first:last + 1] - lo)
        lengths = self.lengths[idx]
        offsets = torch.zeros(len(idx) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        starts = self.offsets[:-1][idx]
        # position j of the output comes from starts[row(j)] + (j - offsets[row(j)])
        row = torch.repeat_interleave(torch.arange(len(idx)), lengths)
        gather = starts[row] + torch.arange(int(offsets[-1])) - offsets[:-1][row]
        return Ragged(self.values[gather], offsets)

    @staticmethod
    def cat(parts: Sequence[Ragged]) -> Ragged:
        values = torch.cat([p.values for p in parts])
        lengths = torch.cat([p.lengths for p in parts])
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return Ragged(values, offsets)

    def padded(self, width: int | None = None, pad: float = 0) -> torch.Tensor:
        """[N, width] right-padded with `pad` (width: the longest row)."""
        lengths = self.lengths
        width = int(lengths.max()) if width is None and len(lengths) else (width or 0)
        out = torch.full((len(self), width), pad, dtype=self.values.dtype)
        keep = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        out[keep] = self.values
        return out


def _from_numpy(values, offsets) -> Ragged:
    """A Ragged over unpickled arrays. Arrays Ray hands out are read-only views of its object
    store: the tensors share them (no copy) and, like every received batch, are never written in
    place (results go into new tensors: `full_like`, `with_values`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return Ragged(torch.from_numpy(values), torch.from_numpy(offsets))
