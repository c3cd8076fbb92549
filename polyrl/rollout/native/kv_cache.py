"""A static per-slot KV cache that grows by doubling and keeps live sequences in slots 0..B-1.

Each running sequence owns one slot (a row of the cache). Keeping the live rows contiguous means a
decode step reads `k[layer, :B, :, :L]` as a plain view: no gather, no torch.cat growth, one
batched matmul per layer. When a sequence leaves, the last live row is copied into its hole.
Capacity grows lazily (a short prompt never pays for max_model_len) and `release()` frees it all
for `sleep()`.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self._dims = (num_layers, num_kv_heads, head_dim)
        self.max_slots, self.max_len = max_slots, max_len
        self.dtype, self.device = dtype, device
        # K is stored transposed so q @ K^T reads it in place (no per-step copy of the keys).
        self.k: torch.Tensor | None = None  # [layers, slots, kv_heads, head_dim, capacity]
        self.v: torch.Tensor | None = None  # [layers, slots, kv_heads, capacity, head_dim]
        self.slots = 0
        self.capacity = 0
        self._released_shape: tuple[int, int] | None = None

    def _alloc(self, *shape: int) -> torch.Tensor:
        # zeros, not empty: a masked-out position still enters q @ k^T, and NaN * 0 is NaN.
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def reserve(self, slots: int, length: int) -> None:
        """Make room for `slots` rows of `length` positions, growing geometrically."""
        if slots > self.max_slots or length > self.max_len:
            raise ValueError(f"KV cache request ({slots} slots x {length}) exceeds its limits "
                             f"({self.max_slots} x {self.max_len})")
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = self.slots if slots <= self.slots else min(self.max_slots, max(slots, 2 * self.slots, 8))
        new_cap = self.capacity
        if length > self.capacity:
            new_cap = min(self.max_len, max(-(-length // 64) * 64, 2 * self.capacity))
        layers, kv_heads, head_dim = self._dims
        k = self._alloc(layers, new_slots, kv_heads, head_dim, new_cap)
        v = self._alloc(layers, new_slots, kv_heads, new_cap, head_dim)
        if self.k is not None:
            k[:, : self.slots, :, :, : self.capacity] = self.k
            v[:, : self.slots, :, : self.capacity] = self.v
        self.k, self.v, self.slots, self.capacity = k, v, new_slots, new_cap

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row `src` (its first `length` positions) into row `dst`, across all layers."""
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def release(self) -> None:
        if self.k is not None:
            self._released_shape = (self.slots, self.capacity)
        self.k = self.v = None
        self.slots = self.capacity = 0

    def restore(self) -> None:
        """Re-allocate what `release()` freed, so memory is claimed up front rather than mid-run."""
        if self._released_shape is not None and self.k is None:
            self.reserve(*self._released_shape)
        self._released_shape = None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()
