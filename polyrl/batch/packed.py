"""Packed micro-batches: the chosen samples concatenated into one row with no padding.

Position ids restart at 0 for each sample and `cu_seq_lens` marks where each sample starts
(FlashAttention's varlen convention: [0, L_0, L_0 + L_1, ..., T], int32). The packed attention
(polyrl/training/varlen.py) runs causal attention per sample segment, so no token sees another
sample and the forward computes what the padded layout of `collate` computes, on sum(lengths)
tokens instead of rows x longest, with attention costing sum(L_i^2). `collate_packed(...,
varlen=False)` gives the older layout instead: a dense block-diagonal causal [1, 1, T, T] mask
for any attention (T^2 scores; kept as the benchmark's baseline, benchmarks/packing.py).

Per-token fields stay response-aligned [b, R] exactly as in `MicroBatch`, and so do the rows'
images; only `gather_index` changes meaning: it indexes the packed row (position in [0, T)).
`response_logprobs` (polyrl/training/logprobs.py) reads a packed batch through `position_ids` and
`cu_seq_lens`.

`plan_layout` / `collate_layout` choose between the padded and the packed layout for
`actor.packing` (auto packs where the padded plan would be mostly padding, `PACK_MIN_PADDING`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.batch.micro import MicroBatch, collate, plan_micro_batches
from polyrl.batch.rollout_batch import RolloutBatch


@dataclass
class PackedMicroBatch(MicroBatch):
    position_ids: torch.Tensor | None = None  # [1, T] restarting at 0 per sample
    cu_seq_lens: torch.Tensor | None = None  # [b + 1] int32 sample boundaries (None: dense-mask layout)
    sequence_shard: object | None = None
    """Under sequence parallelism, the slice of the row this rank computes (input / position ids
    hold that slice only; polyrl/training/ulysses.py SequenceShard); None: the whole row."""


def collate_packed(batch: RolloutBatch, indices: list[int] | torch.Tensor, device: torch.device,
                   varlen: bool = True) -> PackedMicroBatch:
    """Pack the samples of `batch` at `indices` into one row on `device`: with segment boundaries
    for the packed attention (`varlen`), else with a dense block-diagonal causal mask."""
    mb = collate(batch, indices, torch.device("cpu"))  # the response-aligned fields, as padded
    fed = mb.attention_mask.sum(1)  # tokens fed per sample (prompt + response - 1)
    T = int(fed.sum())
    starts = torch.cumsum(fed, 0) - fed
    real = mb.attention_mask.bool()
    input_ids = mb.input_ids[real].unsqueeze(0)  # row-major: sample after sample
    seq = torch.repeat_interleave(torch.arange(len(fed)), fed)
    position_ids = (torch.arange(T) - starts[seq]).unsqueeze(0)
    if varlen:
        mask, cu_seq_lens = None, torch.cat([starts, fed.sum().reshape(1)]).to(torch.int32)
    else:
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask, cu_seq_lens = ((seq.unsqueeze(0) == seq.unsqueeze(1)) & causal)[None, None], None
    R = mb.gather_index.shape[1]
    live = torch.arange(R).unsqueeze(0) < mb.response_lengths.unsqueeze(1)
    gather_index = (mb.gather_index + starts.unsqueeze(1)) * live

    def dev(t):
        return None if t is None else t.to(device)

    return PackedMicroBatch(
        input_ids=input_ids.to(device), attention_mask=dev(mask),
        gather_index=gather_index.to(device), target_ids=dev(mb.target_ids), response_mask=dev(mb.response_mask),
        old_logprobs=dev(mb.old_logprobs), rollout_logprobs=dev(mb.rollout_logprobs),
        advantages=dev(mb.advantages), ref_logprobs=dev(mb.ref_logprobs), values=dev(mb.values),
        returns=dev(mb.returns), indices=mb.indices, response_lengths=mb.response_lengths,
        images=None if mb.images is None else mb.images.to(device), image_index=mb.image_index,
        image_objects=mb.image_objects, prompt_lengths=mb.prompt_lengths,
        position_ids=position_ids.to(device), cu_seq_lens=dev(cu_seq_lens),
        routes=None if mb.routes is None else mb.routes[real].unsqueeze(0).to(device))


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


PACK_MIN_PADDING = 0.25
"""`actor.packing=auto` packs a batch whose padded plan would be at least this fraction padding
(padded tokens / tokens computed). A size rule, never a run-time timing, so a run's numerics
follow its shapes; the value is measured (docs/benchmarks.md, "Sequence packing")."""


def padding_fraction(lengths: list[int] | torch.Tensor, token_budget: int) -> float:
    """The share of padding in the tokens the padded plan (`plan_micro_batches`) would compute."""
    return _padding_of(lengths, plan_micro_batches(lengths, token_budget))


def _padding_of(lengths: list[int] | torch.Tensor, plan: list[list[int]]) -> float:
    lengths = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    computed = sum(len(idx) * max(lengths[i] for i in idx) for idx in plan)
    return 1.0 - sum(lengths) / computed if computed else 0.0


def plan_layout(lengths: list[int] | torch.Tensor, token_budget: int, packing: str) -> tuple[bool, list[list[int]]]:
    """(packed, micro-batch plan) for `actor.packing`: on packs, off pads, auto packs when the
    padded plan's padding fraction is at least `PACK_MIN_PADDING`."""
    if packing not in ("auto", "on", "off"):
        raise ValueError(f"actor.packing={packing!r}: choose auto, on or off")
    if packing == "off":
        return False, plan_micro_batches(lengths, token_budget)
    if packing == "auto":
        padded = plan_micro_batches(lengths, token_budget)
        if _padding_of(lengths, padded) < PACK_MIN_PADDING:
            return False, padded
    return True, plan_packed(lengths, token_budget)


def collate_layout(batch: RolloutBatch, indices: list[int] | torch.Tensor, device: torch.device,
                   packed: bool) -> MicroBatch:
    """`collate_packed` (segment boundaries) or `collate`, as `plan_layout` decided."""
    return collate_packed(batch, indices, device) if packed else collate(batch, indices, device)
