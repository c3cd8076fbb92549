"""Micro-batches: the padded tensors one forward/backward pass reads.

*Response-aligned*: row i, column k is the k-th response token of sample i. Every per-token
quantity (log-probs, advantages, masks) uses that layout, so prompt positions never get logits
computed for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polyrl.batch.images import distinct
from polyrl.batch.ragged import Ragged
from polyrl.batch.rollout_batch import RolloutBatch
from polyrl.batch.routes import input_routes


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] right-padded with 0
    attention_mask: torch.Tensor | None  # [b, L]; None for a packed row (polyrl/batch/packed.py)
    gather_index: torch.Tensor  # [b, R] position whose logits predict response token k
    target_ids: torch.Tensor  # [b, R] response tokens
    response_mask: torch.Tensor  # [b, R] float, the loss mask (0 on padding and unsampled tokens)
    old_logprobs: torch.Tensor | None  # [b, R] proximal if recomputed, else the rollout's
    rollout_logprobs: torch.Tensor | None  # [b, R] behaviour policy (the engine's)
    advantages: torch.Tensor | None  # [b, R]
    ref_logprobs: torch.Tensor | None  # [b, R]
    values: torch.Tensor | None  # [b, R] the critic's values at rollout time
    returns: torch.Tensor | None  # [b, R] GAE returns (the critic's targets)
    indices: torch.Tensor
    """[b] positions of these samples in the batch they were cut from."""
    response_lengths: torch.Tensor
    """[b] real response tokens per row (entries past it are padding)."""
    images: Any | None = None
    """The rows' distinct images (`ImageInputs`, polyrl/data/multimodal.py; the samples of one
    prompt share theirs) concatenated: what the vision tower encodes in one call, each prompt's
    images once however many of its samples the micro-batch holds; None when no row has any."""
    image_index: torch.Tensor | None = None
    """[b] int64, set with `images`: which of the distinct `ImageInputs` is row i's (-1: none)."""
    image_objects: torch.Tensor | None = None
    """[k] int64, set with `images`: images of each distinct `ImageInputs`, in order."""
    prompt_lengths: torch.Tensor | None = None
    """[b] prompt tokens per row, set with `images`: image placeholders count only there (a
    sampled response token is text, whatever its id)."""
    routes: torch.Tensor | None = None
    """[b, L, moe layers, k] int64 expert ids to replay at each input position (-1: the router
    chooses), from the batch's routes column (polyrl/batch/routes.py); None without one."""

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def collate(batch: RolloutBatch, indices: list[int] | torch.Tensor, device: torch.device) -> MicroBatch:
    """Right-pad the samples of `batch` at `indices` into one micro-batch on `device`."""
    idx = torch.as_tensor(indices, dtype=torch.long)
    sub = batch.select(idx)
    P, R_len = sub.prompt_ids.lengths, sub.response_ids.lengths
    # the last token's hidden state predicts nothing that is scored: feed all but it
    fed = P + R_len - 1
    L = int(fed.max()) if len(idx) else 0
    R = max(int(R_len.max()) if len(idx) else 0, 1)
    prompt = sub.prompt_ids.padded(max(int(P.max()), 1))
    response = sub.response_ids.padded(R)
    t = torch.arange(L).unsqueeze(0)
    from_prompt = prompt.gather(1, t.clamp(max=prompt.shape[1] - 1).expand(len(idx), -1))
    from_response = response.gather(1, (t - P.unsqueeze(1)).clamp(0, R - 1))
    attention = t < fed.unsqueeze(1)
    input_ids = torch.where(t < P.unsqueeze(1), from_prompt, from_response) * attention
    k = torch.arange(R).unsqueeze(0)
    real = k < R_len.unsqueeze(1)
    # logits at position t predict token t+1: response token k sits at p+k, read from p+k-1
    gather_index = (P.unsqueeze(1) - 1 + k) * real
    mask = sub.loss_mask.padded(R).float() * real

    def rows(r: Ragged | None) -> torch.Tensor | None:
        return None if r is None else r.padded(R).float().to(device)

    old = sub.old_logprobs if sub.old_logprobs is not None else sub.rollout_logprobs
    images = index = per_object = None
    if sub.images is not None and any(x is not None for x in sub.images):
        from polyrl.data.multimodal import ImageInputs

        objects, index = distinct(sub.images)
        images = ImageInputs.concat(objects).to(device)
        per_object = torch.tensor([x.num_images for x in objects], dtype=torch.long)
    routes = None
    if sub.routes is not None and L:
        routes = input_routes(sub.routes, P, L).to(device)
    return MicroBatch(
        routes=routes,
        input_ids=input_ids.to(device), attention_mask=attention.long().to(device),
        gather_index=gather_index.to(device), target_ids=response.to(device),
        response_mask=mask.to(device), old_logprobs=rows(old),
        rollout_logprobs=rows(sub.rollout_logprobs), advantages=rows(sub.token_advantage_rows()),
        ref_logprobs=rows(sub.ref_logprobs), values=rows(sub.values), returns=rows(sub.returns),
        indices=idx, response_lengths=R_len,
        images=images, image_index=index, image_objects=per_object, prompt_lengths=None if images is None else P,
    )


def plan_micro_batches(lengths: list[int] | torch.Tensor, token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `token_budget` tokens *after padding*
    (rows x longest row; a single sample longer than the budget gets a micro-batch of its own).

    Sorting by length first keeps padding small without the block-diagonal masks a packed
    layout would need on backends without variable-length attention kernels (CPU SDPA).
    """
    lengths = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        if current and max(longest, lengths[i]) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def scatter_rows(target: Ragged, mb: MicroBatch, values: torch.Tensor) -> None:
    """Write a micro-batch's [b, R] per-token `values` into `target` (a Ragged shaped like the
    full batch's responses) at the micro-batch's rows, in place."""
    real = torch.arange(values.shape[1]).unsqueeze(0) < mb.response_lengths.unsqueeze(1)
    starts = target.offsets[:-1][mb.indices]
    pos = (starts.unsqueeze(1) + torch.arange(values.shape[1]).unsqueeze(0))[real]
    target.values[pos] = values.detach().to(target.values.device, target.values.dtype)[real]
