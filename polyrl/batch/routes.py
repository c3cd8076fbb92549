"""The routes column: which experts a mixture-of-experts engine chose for each response token, to
replay in the trainer (rollout routing replay, `actor.router_replay`; docs/moe.md).

A `Ragged` aligned with `response_ids` whose values are 3-D: [response tokens, moe layers, k],
the top-k expert ids of each MoE layer, stored compactly as uint8 (fewer than 255 experts) or
uint16 (Ragged's select / cat / pickling work on the first dimension). Row j holds the routes of response token j *as the model's input*, i.e.
computed while the token after it was sampled. The dtype's largest value marks a row the engine
did not route (the last sampled token, which is never fed back; tool or environment tokens of a
multi-turn sample, and each assistant turn's last token, fed only by the next turn's prefill
(polyrl/agents/stats.py); an engine that records nothing): the trainer routes those tokens
itself, as it does every prompt token. A resumed partial rollout's segments are `joined`: its
earlier segment's last token takes the routes the continuation's prefill gave it (the engine's
`TokenOutput.extra["prompt_routed_experts"]`), so the whole response is replayed.

`input_routes` turns a micro-batch's rows into the [b, L, layers, k] int64 replay tensor of the
padded input layout (-1: the router chooses); the packed layout takes the same tensor's real
positions (polyrl/batch/packed.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from polyrl.batch.ragged import Ragged


def routes_dtype(num_experts: int) -> torch.dtype:
    """uint8 below 255 experts, uint16 below 65535 (the largest value is the not-routed mark)."""
    if num_experts < 255:
        return torch.uint8
    if num_experts < 65535:
        return torch.uint16
    raise ValueError(f"{num_experts} experts do not fit the routes column (at most 65534)")


def not_routed(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).max


def encode(rows: torch.Tensor | None, length: int, dtype: torch.dtype, layers: int, top_k: int) -> torch.Tensor:
    """One sample's routes [length, layers, k] in `dtype`: `rows` [r, layers, k] for its first r
    response tokens (r <= length), the rest marked not routed."""
    out = torch.full((length, layers, top_k), not_routed(dtype), dtype=dtype)
    if rows is not None and len(rows):
        r = min(len(rows), length)
        out[:r] = rows[:r].to(dtype)
    return out


def joined(first: torch.Tensor, boundary: torch.Tensor | None, rest: torch.Tensor) -> torch.Tensor:
    """A resumed sample's routes (polyrl/workers/partial_rollout.py): the earlier segment's
    `first` [a, layers, k], then the continuation's `rest`. The earlier segment's last token was
    never fed there (marked); the continuation fed it as its prompt's last token, whose routes
    are `boundary` [layers, k] (`TokenOutput.extra["prompt_routed_experts"]`; None: it stays
    marked, the trainer routes it)."""
    first = first.clone()
    if len(first) and boundary is not None:
        first[-1] = boundary.to(first.dtype)
    return torch.cat([first, rest.to(first.dtype)])


def cut(routes: torch.Tensor, length: int) -> torch.Tensor:
    """A sample's routes cut to its first `length` tokens: the new last token is never fed back."""
    out = routes[:length].clone()
    if length:
        out[-1] = not_routed(out.dtype)
    return out


def routes_column(per_sample: Sequence[torch.Tensor]) -> Ragged:
    """The column from each sample's [response length, layers, k] routes (`encode`)."""
    lengths = torch.tensor([len(r) for r in per_sample], dtype=torch.long)
    offsets = torch.zeros(len(per_sample) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Ragged(torch.cat(list(per_sample)), offsets)


def engine_routes(outputs: Sequence[Any]) -> Ragged | None:
    """The column from engine outputs (`TokenOutput`s) whose `extra["routed_experts"]` holds each
    sample's [tokens, layers, k] routes; None unless every output has them (an engine that
    records none, a dense model). A sample whose routes do not cover its tokens one for one, or
    that has none (a resumed partial rollout with a segment the engine recorded none for) is
    marked not routed: the trainer routes it itself."""
    found = [getattr(o, "extra", {}).get("routed_experts") for o in outputs]
    first = next((r for r in found if r is not None), None)
    if first is None:
        return None
    dtype, (_, layers, k) = first.dtype, first.shape
    rows = [r if r is not None and len(r) == len(o.token_ids) else encode(None, len(o.token_ids), dtype, layers, k)
            for r, o in zip(found, outputs)]
    return routes_column(rows)


def input_routes(routes: Ragged, prompt_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width_in, layers, k] int64 expert ids per input position of the padded layout
    (`collate`: sample i's response token j sits at position P_i + j); -1 where the router
    chooses (prompt positions, padding - a shorter sample's last response token is padding there,
    never an input -, rows not routed)."""
    b = len(routes)
    _, layers, top_k = routes.values.shape
    mark = not_routed(routes.values.dtype)
    out = torch.full((b, width, layers, top_k), -1, dtype=torch.long)
    values = routes.values.long()  # (uint16 has no index_put)
    values = torch.where(values == mark, torch.full_like(values, -1), values)
    for i in range(b):  # per sample, a slice copy (never per token)
        lo, hi = int(routes.offsets[i]), int(routes.offsets[i + 1])
        p = int(prompt_lengths[i])
        n = max(min(hi - lo - 1, width - p), 0)  # the last token is never an input
        if n:
            out[i, p: p + n] = values[lo: lo + n]
    return out
