"""Log-probs and entropy over a vocabulary-parallel LM head (tensor parallelism,
training/tensor_parallel.py), without the full logits on any rank.

Each tp rank holds rows [start, start + V_r) of the head and computes only those logits
z_r = h W_r^T. What a softmax needs of the rest is three numbers per token, all-reduced over the
tp group in the forward:

    m   = max over ranks of max z_r                      (for a stable exp)
    lse = m + log sum over ranks of sum exp(z_r - m)
    z_t = the target's logit, from the rank owning it    (others add 0)
    sum p z over ranks                                   (entropy = lse - sum p z)

so log p(target) = z_t - lse and every rank gets the same values. The backward needs no
communication for the head: d/dz_r is local (onehot - p for the log-prob,
-p (log p + entropy) for the entropy), and so is the head's gradient, which is this rank's rows.
The hidden states' gradient is a partial sum, h's gradient from each slice of the vocabulary,
and is all-reduced over the tp group: the step ColwiseParallel's input takes elsewhere.

Rows go in chunks, each chunk's logits recomputed in the backward (as logprobs.py's fused path
does for a whole head), so not even [tokens, V_r] is kept for the backward: a 32K-token
micro-batch of a 152K vocabulary would otherwise hold 10 GB of float32 per rank at tp=2.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def vocab_shard(weight: torch.Tensor):
    """(local rows, first row, tp group) of a head weight sliced by rows over a tp mesh; None for
    any other weight (a plain tensor, or an fsdp2 shard outside a forward). Checked without
    importing torch.distributed.tensor, as sharded_load.is_dtensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(weight, module.DTensor):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or mesh.mesh_dim_names != ("tp",) or not weight.placements[0].is_shard(0):
        return None
    group = mesh.get_group()
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-weight.shape[0] // ranks)  # DTensor slices dim 0 as torch.chunk does
    local = weight.to_local()
    start = min(weight.shape[0], me * chunk)
    if local.shape[0] != max(0, min(weight.shape[0], start + chunk) - start):
        raise RuntimeError(f"vocab-parallel head: {local.shape[0]} rows at {start} on tp rank {me} of {ranks} "
                           f"is not torch.chunk's slice of {weight.shape[0]}")
    return local, start, group


def vocab_parallel_logprobs(hidden: torch.Tensor, shard, targets: torch.Tensor, with_entropy: bool = True,
                            rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [n, H] (the same on every tp rank), `shard` from `vocab_shard`, targets [n] ->
    (log p(target) [n], entropy [n] or None), float32, the same on every tp rank. Rows go in
    chunks of `rows` (default: about logprobs.CHUNK_ELEMENTS local logits), the backward
    recomputing each chunk's logits, as logprobs.fused_logprobs does for a whole head: autograd
    keeps the hidden states and two floats per row, never [n, V_r]."""
    from polyrl.training.logprobs import CHUNK_ELEMENTS, MIN_CHUNK_ROWS

    local, start, group = shard
    dtype = local.dtype
    if torch.is_autocast_enabled(hidden.device.type):  # the head matmul in the autocast dtype, like Linear
        dtype = torch.get_autocast_dtype(hidden.device.type)
    rows = rows or max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(local.shape[0], 1))
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent = _VocabParallelLogProbs.apply(hidden, local, targets, start, group, dtype, with_entropy, rows)
    return lp, ent if with_entropy else None


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, start, group, dtype, with_entropy, rows):
        n, w = hidden.shape[0], weight.to(dtype)
        lse = hidden.new_empty(n, dtype=torch.float32)
        logprob = hidden.new_zeros(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n if with_entropy else 0, dtype=torch.float32)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < weight.shape[0])
        for s in range(0, n, rows):
            e = min(s + rows, n)
            z = (hidden[s:e].to(dtype) @ w.t()).float()  # [c, V_r]: this rank's logits only
            m = z.max(-1).values if z.shape[1] else z.new_full((e - s,), float("-inf"))
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sumexp = (z - m.unsqueeze(1)).exp().sum(-1)
            dist.all_reduce(sumexp, group=group)
            lse[s:e] = m + sumexp.log()
            logp = z.sub_(lse[s:e].unsqueeze(1))  # in place: the chunk's only [c, V_r] float buffer
            picked = logp.gather(1, local_t[s:e].clamp(0, max(logp.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1)
            logprob[s:e] = torch.where(mine[s:e], picked, torch.zeros_like(picked))
            if with_entropy:
                entropy[s:e] = -(logp.exp().mul_(logp)).sum(-1)
        dist.all_reduce(logprob, group=group)  # the target's owner contributes it, the others 0
        if with_entropy:
            dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(hidden, weight, lse, local_t, mine, entropy)
        ctx.group, ctx.dtype, ctx.rows = group, dtype, rows
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        from polyrl.training.logprobs import chunk_logit_grads

        hidden, weight, lse, local_t, mine, entropy = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        w = weight.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        chunks = chunk_logit_grads(hidden, w, lse, entropy, grad_logprob, grad_entropy, rows)
        for s, e, h, g, gz in chunks:  # gz [c, V_r]: this rank's logits only
            own = mine[s:e].nonzero().squeeze(1)  # the one-hot term: only where this rank owns the target
            gz[own, local_t[s:e][own]] += g[own]
            gz = gz.to(dtype)
            if need_h:
                grad_hidden[s:e] = (gz @ w).float()
            if need_w:
                grad_w.add_((gz.t() @ h).float())
        if need_h:
            dist.all_reduce(grad_hidden, group=ctx.group)  # each vocabulary slice's share of d/dh
            grad_hidden = grad_hidden.to(hidden.dtype)
        return (grad_hidden, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None)
