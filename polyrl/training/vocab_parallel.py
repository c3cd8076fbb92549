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


def vocab_parallel_logprobs(hidden: torch.Tensor, shard, targets: torch.Tensor, with_entropy: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [n, H] (the same on every tp rank), `shard` from `vocab_shard`, targets [n] ->
    (log p(target) [n], entropy [n] or None), float32, the same on every tp rank."""
    local, start, group = shard
    dtype = local.dtype
    if torch.is_autocast_enabled(hidden.device.type):  # the head matmul in the autocast dtype, like Linear
        dtype = torch.get_autocast_dtype(hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent = _VocabParallelLogProbs.apply(hidden, local, targets, start, group, dtype, with_entropy)
    return lp, ent if with_entropy else None


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, start, group, dtype, with_entropy):
        z = (hidden.to(dtype) @ weight.to(dtype).t()).float()  # [n, V_r]: this rank's logits only
        m = z.max(-1).values if z.shape[1] else z.new_full((z.shape[0],), float("-inf"))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sumexp = (z - m.unsqueeze(1)).exp().sum(-1)
        dist.all_reduce(sumexp, group=group)
        lse = m + sumexp.log()
        logp = z.sub_(lse.unsqueeze(1))  # in place: [n, V_r] log-probs of this rank's rows
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < logp.shape[1])
        picked = logp.gather(1, local_t.clamp(0, max(logp.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1)
        logprob = torch.where(mine, picked, torch.zeros_like(picked))
        dist.all_reduce(logprob, group=group)
        entropy = logp.new_empty(0)
        if with_entropy:
            entropy = -(logp.exp() * logp).sum(-1)
            dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(hidden, weight, logp, local_t, mine, entropy)
        ctx.group, ctx.dtype = group, dtype
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, logp, local_t, mine, entropy = ctx.saved_tensors
        n = hidden.shape[0]
        if grad_logprob is None:
            grad_logprob = logp.new_zeros(n)
        g = grad_logprob.unsqueeze(1)
        p = logp.exp()
        # d logp_t / dz = onehot_t - p;  d entropy / dz = -p * (logp + entropy)
        if grad_entropy is not None and entropy.numel() == n:
            gz = -(p * (logp + entropy.unsqueeze(1)) * grad_entropy.unsqueeze(1) + p * g)
        else:
            gz = -(p * g)
        rows = mine.nonzero().squeeze(1)
        gz[rows, local_t[rows]] += grad_logprob[rows]
        gz = gz.to(ctx.dtype)
        w = weight.to(ctx.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (gz @ w).to(hidden.dtype)
            dist.all_reduce(grad_hidden, group=ctx.group)  # each vocabulary slice's share of d/dh
        if ctx.needs_input_grad[1]:
            grad_weight = (gz.t() @ hidden.to(ctx.dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
