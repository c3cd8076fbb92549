"""What travels between the driver and the policy workers, and its tensor form.

Samples travel as plain lists (cheap to pickle); a worker turns a group of them into
*response-aligned* tensors: row i, column k is the k-th response token of sample i. Every
per-token quantity (log-probs, advantages, masks) uses that layout, so prompt positions never
get logits computed for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None = None
    """Log-probs the engine computed while sampling (same layout as response_ids)."""
    old_logprobs: list[float] | None = None
    """Proximal log-probs: the trainer's pre-update policy, recomputed when an update takes
    several optimizer steps (None: the PPO ratio's old side is `rollout_logprobs` or, for a
    single-step update, the detached forward)."""
    advantages: list[float] | None = None
    ref_logprobs: list[float] | None = None
    weight_version: int = 0
    """Weight version the engine served when the response finished."""
    min_version: int = 0
    """Oldest policy version that produced any token of the response (async: staleness)."""
    max_version: int = 0
    """Newest policy version that produced any token (differs after a partial rollout)."""
    group: int = 0
    """Index of the prompt this sample answers (GRPO group)."""
    finished_with_eos: bool = False
    stop_reason: str = "length"
    reward: float = 0.0
    acc: float = 0.0
    text: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] right-padded with 0
    attention_mask: torch.Tensor  # [b, L]
    gather_index: torch.Tensor  # [b, R] position whose logits predict response token k
    target_ids: torch.Tensor  # [b, R] response tokens
    response_mask: torch.Tensor  # [b, R] float, 1 on real response tokens
    old_logprobs: torch.Tensor | None  # [b, R] proximal if recomputed, else the rollout's
    rollout_logprobs: torch.Tensor | None  # [b, R] behaviour policy (the engine's)
    advantages: torch.Tensor | None  # [b, R]
    ref_logprobs: torch.Tensor | None  # [b, R]
    indices: list[int]
    """Positions of these samples in the caller's list."""

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def _pad(rows: list[list[float]] | None, width: int, dtype: torch.dtype) -> torch.Tensor | None:
    if rows is None or any(r is None for r in rows):
        return None
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=dtype).reshape(len(rows), width)


def collate(samples: list[Sample], indices: list[int], device: torch.device) -> MicroBatch:
    """Right-pad the samples at `indices` into one micro-batch on `device`."""
    chosen = [samples[i] for i in indices]
    # the last token's hidden state predicts nothing that is scored: feed all but it
    L = max(s.length for s in chosen) - 1
    R = max(max(len(s.response_ids) for s in chosen), 1)
    # one tensor per field from padded Python lists: a per-row tensor copy costs more than the row
    seqs = [(s.prompt_ids + s.response_ids)[:-1] for s in chosen]
    input_ids = _pad(seqs, L, torch.long)
    attention = _pad([[1] * len(q) for q in seqs], L, torch.long)
    # logits at position t predict token t+1: response token k sits at p+k, read from p+k-1
    gather = _pad([range(len(s.prompt_ids) - 1, s.length - 1) for s in chosen], R, torch.long)
    targets = _pad([s.response_ids for s in chosen], R, torch.long)
    mask = _pad([[1.0] * len(s.response_ids) for s in chosen], R, torch.float32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        gather_index=gather.to(device),
        target_ids=targets.to(device),
        response_mask=mask.to(device),
        old_logprobs=to(_pad([s.old_logprobs if s.old_logprobs is not None else s.rollout_logprobs
                              for s in chosen], R, torch.float32)),
        rollout_logprobs=to(_pad([s.rollout_logprobs for s in chosen], R, torch.float32)),
        advantages=to(_pad([s.advantages for s in chosen], R, torch.float32)),
        ref_logprobs=to(_pad([s.ref_logprobs for s in chosen], R, torch.float32)),
        indices=list(indices),
    )


def plan_micro_batches(samples: list[Sample], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `token_budget` padded tokens.

    Sorting by length first keeps padding small without the block-diagonal masks a packed
    layout would need on backends without variable-length attention kernels (CPU SDPA).
    """
    order = sorted(range(len(samples)), key=lambda i: samples[i].length)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = samples[i].length
        if current and max(longest, length) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def split_evenly(items: list, parts: int) -> list[list]:
    """Exactly `parts` contiguous chunks (some may be empty), sizes differing by at most one.

    Every rank must run the same number of optimizer steps (each ends in a collective), so a
    chunk list never gets shorter when there are fewer items than parts."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
