"""Sequence parallelism (DeepSpeed-Ulysses): one packed row's tokens split over k ranks.

Under `actor.sequence_parallel_size=k` the k ranks of one sp group (training/mesh.py) hold the
same micro-batch. `shard_micro_batch` pads the packed row (polyrl/batch/packed.py) to a multiple
of k tokens and gives each rank a contiguous 1/k of its input ids and position ids. Everything
per token (embeddings, norms, MLPs, rotary) then runs on the slice alone; attention needs every
token of a sample, so around it (`ulysses_attention`, called by the packed attention of
training/varlen.py) an all-to-all turns [tokens/k, all heads] into [all tokens, heads/k], the
per-sample attention runs on its heads, and a second all-to-all turns the output back. Peak
activations per rank are those of T/k tokens plus one layer's attention over T tokens on H/k
heads (docs/training.md, "Sequence parallelism").

The head reads only the rank's own positions (`own_positions`): each response token's log-prob
(or a critic's value) is computed on the rank holding the hidden state that predicts it, zero
elsewhere, and `gather_shards` sums the k disjoint pieces, so every rank holds the whole [b, R]
and computes the same loss. Its backward passes the gradient through unchanged: rank i seeds
only its own positions, the all-to-alls carry gradients between the ranks' tokens, and the sum
of the k ranks' parameter gradients is the unsplit gradient (the engines sum gradients over the
data and sp axes: mesh.py `gradient_group`).

Under tensor parallelism too (training/tensor_parallel.py) nothing here changes: the projections
hand each rank its H/tp heads as local tensors, the all-to-all over the rank's sp group (the sp
ranks of the same tp index) splits those into H/(tp k), and the tp ranks of one sp index hold
the same token slice, so the vocabulary-parallel head (training/vocab_parallel.py) all-reduces
over tp the rows of the same positions before `gather_shards` sums the sp pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sp group."""
    group: Any
    size: int
    index: int


@dataclass(frozen=True)
class SequenceShard:
    """The slice [start, end) of a padded packed row this rank computes (a micro-batch's
    `sequence_shard`); the model's attention reads it from the forward's keyword arguments."""
    sp: SequenceParallel
    start: int
    end: int
    tokens: int = 0
    """The row's real tokens (before the padding to a multiple of k): positions >= it are padding."""


def check_heads(model: torch.nn.Module, k: int, tp: int = 1) -> None:
    """Heads are what the all-to-all splits: query and key-value heads must divide by k. Under
    tensor parallelism a rank holds H/tp of them (training/tensor_parallel.py) and splits those,
    so the heads must divide by k x tp."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % (k * tp) or kv_heads % (k * tp):
        name = getattr(config, "_name_or_path", "") or type(model).__name__
        if tp > 1:
            raise ValueError(f"actor.sequence_parallel_size={k} x actor.tensor_parallel_size={tp}: model {name} has "
                             f"{heads} attention heads and {kv_heads} key-value heads, which must both divide by "
                             f"{k * tp} (each tp rank splits its 1/{tp} of them over the sp ranks); lower "
                             "actor.sequence_parallel_size or actor.tensor_parallel_size")
        raise ValueError(f"actor.sequence_parallel_size={k}: model {name} has {heads} attention heads and "
                         f"{kv_heads} key-value heads, which must both divide by {k}; choose a divisor of {kv_heads}")


def shard_micro_batch(mb, sp: SequenceParallel):
    """This rank's slice of a packed micro-batch: the row padded to a multiple of `sp.size` (the
    padding is one more segment of its own, attending only itself and never read), input and
    position ids - and a mixture-of-experts policy's replayed routes - cut to [start, end); the
    response-aligned fields stay whole."""
    if getattr(mb, "cu_seq_lens", None) is None:
        raise ValueError("sequence parallelism splits packed rows with segment boundaries; got a padded micro-batch")
    T = mb.input_ids.shape[1]
    _same_row_on_every_rank(mb, sp)
    per_rank = -(-T // sp.size)
    pad = per_rank * sp.size - T
    ids, pos, cu = mb.input_ids, mb.position_ids, mb.cu_seq_lens
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device).unsqueeze(0)], 1)
        cu = torch.cat([cu, cu.new_tensor([T + pad])])
    start, end = sp.index * per_rank, (sp.index + 1) * per_rank
    routes = mb.routes  # routing replay: the routes are cut like the tokens
    if routes is not None:
        if pad:  # the padding segment: -1, its router chooses (training/moe_replay.py)
            routes = torch.cat([routes, routes.new_full((1, pad, *routes.shape[2:]), -1)], 1)
        routes = routes[:, start:end]
    return replace(mb, input_ids=ids[:, start:end], position_ids=pos[:, start:end], cu_seq_lens=cu,
                   sequence_shard=SequenceShard(sp, start, end, T), routes=routes)


def _same_row_on_every_rank(mb, sp: SequenceParallel) -> None:
    """The ranks of a group must split the same row: a driver that sharded the batch over every
    rank (not over the mesh's data ranks) would otherwise exchange heads of unrelated rows."""
    facts = torch.tensor([mb.cu_seq_lens.numel(), int(mb.cu_seq_lens[-1]), int(mb.input_ids.sum())],
                         dtype=torch.int64, device=mb.input_ids.device)
    extremes = torch.cat([facts, -facts])  # one MAX all-reduce gives the maxima and the minima
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=sp.group)
    if not torch.equal(extremes[:3], -extremes[3:]):
        raise RuntimeError("the ranks of a sequence-parallel group were given different samples: shard the batch "
                           "over the data-parallel ranks of the mesh (polyrl/training/mesh.py data_rank)")


# --- attention ----------------------------------------------------------------------------------
def ulysses_attention(attention, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, shard: SequenceShard, **kwargs):
    """`attention` (transformers' signature: [1, H, t, D] in, [1, t, H, D] out) over the whole
    row on H/k heads: all-to-all in, attention, all-to-all back to this rank's t tokens."""
    sp = shard.sp
    # [1, H, t, D] -> [1, H/k, T, D]: send head group j to rank j, receive every rank's tokens
    q, k, v = (_AllToAll.apply(x, sp.group, sp.size, 1, 2) for x in (query, key, value))
    out, weights = attention(module, q, k, v, attention_mask, **kwargs)  # [1, T, H/k, D]
    return _AllToAll.apply(out, sp.group, sp.size, 1, 2).contiguous(), weights  # [1, t, H, D]


def _all_to_all(x: torch.Tensor, group, k: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of `x` along `scatter_dim` goes to rank j; the chunks received, in rank order,
    are concatenated along `gather_dim`."""
    send = torch.stack(x.chunk(k, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` whose backward is the inverse exchange (gather dim scattered back)."""

    @staticmethod
    def forward(ctx, x, group, k, scatter_dim, gather_dim):
        ctx.args = (group, k, gather_dim, scatter_dim)
        return _all_to_all(x, group, k, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), *ctx.args), None, None, None, None


# --- the head ------------------------------------------------------------------------------------
def own_positions(mb, index: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's hidden rows, mask of the response tokens this rank computes):
    `index` [b, R] positions in the packed row, `real` [b, R] the tokens that exist."""
    shard = getattr(mb, "sequence_shard", None)
    if shard is None:
        return index, real
    return index - shard.start, real & (index >= shard.start) & (index < shard.end)


def gather_shards(mb, t: torch.Tensor | None) -> torch.Tensor | None:
    """The [b, R] pieces of the sp group summed (each position is non-zero on one rank only);
    the gradient passes through to this rank's piece unchanged."""
    shard = getattr(mb, "sequence_shard", None)
    if shard is None or t is None:
        return t
    return _SumShards.apply(t, shard.sp.group)


class _SumShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        out = t.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
