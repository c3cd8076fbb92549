"""Packed micro-batches: the chosen samples concatenated into one row with no padding.

Position ids restart at 0 for each sample and the attention mask is block-diagonal and causal
([1, 1, T, T] bool, True = may attend), so no token sees another sample: the forward computes
what the padded layout of `collate` computes, on sum(lengths) tokens instead of rows x longest.
On CPU (no variable-length attention kernel) SDPA reads the dense [T, T] mask, so attention costs
T^2 rather than sum(L_i^2); the saving is in the matmuls of the rest of the model, on length
mixes where padding is large.

Per-token fields stay response-aligned [b, R] exactly as in `MicroBatch`; only `gather_index`
changes meaning: it indexes the packed row (position in [0, T)). `response_logprobs`
(polyrl/training/logprobs.py) reads a packed batch through `position_ids`.

To switch it on, a caller replaces `collate` / `plan_micro_batches` by `collate_packed` /
`plan_packed` (same signatures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.batch.micro import MicroBatch, collate
from polyrl.batch.rollout_batch import RolloutBatch


@dataclass
class PackedMicroBatch(MicroBatch):
    position_ids: torch.Tensor | None = None  # [1, T] restarting at 0 per sample


def collate_packed(batch: RolloutBatch, indices: list[int] | torch.Tensor, device: torch.device) -> PackedMicroBatch:
    """Pack the samples of `batch` at `indices` into one row on `device`."""
    mb = collate(batch, indices, torch.device("cpu"))  # the response-aligned fields, as padded
    fed = mb.attention_mask.sum(1)  # tokens fed per sample (prompt + response - 1)
    T = int(fed.sum())
    starts = torch.cumsum(fed, 0) - fed
    real = mb.attention_mask.bool()
    input_ids = mb.input_ids[real].unsqueeze(0)  # row-major: sample after sample
    seq = torch.repeat_interleave(torch.arange(len(fed)), fed)
    position_ids = (torch.arange(T) - starts[seq]).unsqueeze(0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (seq.unsqueeze(0) == seq.unsqueeze(1)) & causal
    R = mb.gather_index.shape[1]
    live = torch.arange(R).unsqueeze(0) < mb.response_lengths.unsqueeze(1)
    gather_index = (mb.gather_index + starts.unsqueeze(1)) * live

    def dev(t):
        return None if t is None else t.to(device)

    return PackedMicroBatch(
        input_ids=input_ids.to(device), attention_mask=mask[None, None].to(device),
        gather_index=gather_index.to(device), target_ids=dev(mb.target_ids), response_mask=dev(mb.response_mask),
        old_logprobs=dev(mb.old_logprobs), rollout_logprobs=dev(mb.rollout_logprobs),
        advantages=dev(mb.advantages), ref_logprobs=dev(mb.ref_logprobs), values=dev(mb.values),
        returns=dev(mb.returns), indices=mb.indices, response_lengths=mb.response_lengths,
        position_ids=position_ids.to(device))


def plan_packed(lengths: list[int] | torch.Tensor, token_budget: int) -> list[list[int]]:
    """Group sample indices into packs of at most `token_budget` real tokens (no padding counted;
    a sample longer than the budget gets a pack of its own), longest first so big samples spread
    over packs (first-fit decreasing)."""
    lengths = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for p, free in enumerate(room):
            if lengths[i] <= free:
                packs[p].append(i)
                room[p] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(token_budget - lengths[i])
    return packs
