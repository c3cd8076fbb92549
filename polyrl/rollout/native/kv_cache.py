"""A static per-slot KV cache that grows in small steps and keeps live sequences in slots 0..B-1.

Each running sequence owns one slot (a row of the cache). Keeping the live rows contiguous means a
decode step reads `k[layer, :B, :, :L]` as a plain view: no gather, no torch.cat growth, one
batched matmul per layer. When a sequence leaves, the last live row is copied into its hole.
Capacity grows lazily (a short prompt never pays for max_model_len) and `release()` frees it all
for `sleep()`.

Capacity grows to a multiple of 32 positions, by an eighth at least, rather than doubling, so it
stays close to the attended length: oneDNN's bf16 batched GEMMs read only contiguous batches and
copy a `[:L]` slice of every layer's K and V first, so decode attends over the whole capacity in
place when little of it is unused (`attends_in_place`; model.py). The price is a copy of the cache
once every capacity/8 decode steps (30M bf16 model, 64 sequences, 160 positions: 8.5 ms every 32
steps, ~0.3 ms per step against ~6 ms of attention).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

GROWTH = 32
"""Capacity is a multiple of this many positions: oneDNN's bf16 batched GEMMs ran 1.2-1.4x faster
over 64 / 96 / 160 positions than over 48 / 80 / 144 (docs/benchmarks.md, Rollout engine)."""

_ONEDNN_ATTENTION = (torch.bfloat16, torch.float16)
"""Cache dtypes whose CPU batched GEMMs copy non-contiguous operands (fp32 reads them in place)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
        self._masked_capacity = dtype in _ONEDNN_ATTENTION and device.type == "cpu"
        """Whether decode may attend over the whole capacity, masked (`attends_in_place`)."""
        # K is stored transposed so q @ K^T reads it in place (no per-step copy of the keys).
        self.k: torch.Tensor | None = None  # [layers, slots, kv_heads, head_dim, capacity]
        self.v: torch.Tensor | None = None  # [layers, slots, kv_heads, capacity, head_dim]
        self.slots = 0
        self.capacity = 0
        self._released_shape: tuple[int, int] | None = None
        # Prefix reuse across turns: the KV of finished sequences, keyed by the token ids it
        # encodes, least recently used first. A multi-turn trajectory's next prompt extends its
        # previous turn, so its prefill only computes the new tokens. Off while the budget is 0.
        self.prefix_budget = 0
        """Most tokens of finished sequences kept for reuse (0: no reuse)."""
        self._prefixes: OrderedDict[tuple[tuple[int, ...], tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = \
            OrderedDict()  # (token ids, image digests) -> (K, V)
        self._prefix_tokens = 0

    def _alloc(self, *shape: int) -> torch.Tensor:
        # zeros, not empty: a masked-out position still enters q @ k^T, and NaN * 0 is NaN.
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def reserve(self, slots: int, length: int) -> None:
        """Make room for `slots` rows of `length` positions (growing by an eighth at least)."""
        if slots > self.max_slots or length > self.max_len:
            raise ValueError(f"KV cache request ({slots} slots x {length}) exceeds its limits "
                             f"({self.max_slots} x {self.max_len})")
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = self.slots if slots <= self.slots else min(self.max_slots, max(slots, 2 * self.slots, 8))
        new_cap = self.capacity
        if length > self.capacity:
            new_cap = min(self.max_len, _round_up(max(length, self.capacity + self.capacity // 8), GROWTH))
        self._resize(new_slots, new_cap, self.capacity)

    def fit(self, slots: int, length: int) -> None:
        """Before a decode step whose live rows hold positions < `length` only: `reserve`, and
        shrink a capacity that earlier, longer sequences left too large to attend over in place
        (the positions past `length` are dead, so only `[:length]` is kept)."""
        self.reserve(slots, length)
        if self._masked_capacity and not self.attends_in_place(length):
            self._resize(self.slots, min(self.max_len, _round_up(length, GROWTH)), length)

    def _resize(self, slots: int, capacity: int, keep: int) -> None:
        """New buffers of `slots` x `capacity`, holding the first `keep` positions of the old ones."""
        layers, kv_heads, head_dim = self._dims
        k = self._alloc(layers, slots, kv_heads, head_dim, capacity)
        v = self._alloc(layers, slots, kv_heads, capacity, head_dim)
        if self.k is not None:
            k[:, : self.slots, :, :, :keep] = self.k[..., :keep]
            v[:, : self.slots, :, :keep] = self.v[:, :, :, :keep]
        self.k, self.v, self.slots, self.capacity = k, v, slots, capacity

    def attends_in_place(self, length: int) -> bool:
        """Whether decode at attended length `length` reads every position of the capacity (masked
        past each sequence's end) instead of a `[:length]` slice. True for bf16 / fp16 caches on a
        CPU when at most a quarter (or 32 positions) of it is unused: there a slice costs a copy
        of K and V per layer (oneDNN reads contiguous batches only), more than the masked tail."""
        return self._masked_capacity and self.capacity <= length + max(GROWTH, length // 4)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row `src` (its first `length` positions) into row `dst`, across all layers."""
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    # -- prefix reuse -----------------------------------------------------------------------------

    def stash(self, slot: int, tokens: list[int], images: tuple[str, ...] = ()) -> None:
        """Keep row `slot`'s KV for `tokens` (its first len(tokens) positions) for a later prompt.
        `images`: a digest of each image among the tokens (vision.py), part of the key, since the
        same ids with other images have other K/V."""
        if not self.prefix_budget or not tokens or len(tokens) > self.prefix_budget:
            return
        key = (tuple(tokens), images)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return
        n = len(tokens)
        self._prefixes[key] = (self.k[:, slot, :, :, :n].clone(), self.v[:, slot, :, :n].clone())
        self._prefix_tokens += n
        while self._prefix_tokens > self.prefix_budget:
            (old, _), _ = self._prefixes.popitem(last=False)
            self._prefix_tokens -= len(old)

    def take_prefix(self, prompt: list[int], slot: int, images: tuple[str, ...] = ()) -> int:
        """Copy the longest stashed prefix of `prompt` (shorter than it: the last prompt token
        must be computed for its logits) into row `slot`; returns its length (0: none). An entry
        holding k images matches only a prompt whose first k images (digests `images`) are those.

        The entry is removed: the sequence that reuses it stashes its longer self when it ends."""
        best = None
        for key in self._prefixes:
            ids, held = key
            if (len(ids) < len(prompt) and (best is None or len(ids) > len(best[0]))
                    and held == images[: len(held)] and tuple(prompt[: len(ids)]) == ids):
                best = key
        if best is None:
            return 0
        k, v = self._prefixes.pop(best)
        n = len(best[0])
        self._prefix_tokens -= n
        self.k[:, slot, :, :, :n] = k
        self.v[:, slot, :, :n] = v
        return n

    def clear_prefixes(self) -> None:
        """Forget every stashed prefix (new weights make them stale)."""
        self._prefixes.clear()
        self._prefix_tokens = 0

    def release(self) -> None:
        self.clear_prefixes()
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
        live = 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()
        return live + sum(k.numel() * k.element_size() * 2 for k, _ in self._prefixes.values())
