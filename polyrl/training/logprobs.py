"""Per-token log-probs of response tokens, computing logits only where they are needed.

The LM head is the largest matmul of a small model's forward (vocab x hidden per position);
running it on prompt positions, as `model(input_ids).logits` does, wastes most of those FLOPs.

With a large vocabulary the head's *output* is the problem: a float32 [rows, vocab] block of
logits, its log-softmax and their gradients are gigabytes at 150k tokens (and, on CPU, tensors
above glibc's 32 MB mmap threshold are handed back to the kernel on every free and page-faulted
in again on the next step). Above `FUSED_MIN_ELEMENTS` logits the head runs as
`fused_logprobs`: rows in chunks of about `CHUNK_ELEMENTS` logits, one pass per chunk for
logsumexp, target log-prob and entropy, and a backward that recomputes the chunk's logits, so
autograd keeps only the hidden states (plus two floats per row). Below it the plain path is
faster: its extra head matmul in the backward costs more than the memory traffic it saves
(docs/benchmarks.md, "Fused log-prob + entropy").

Under tensor parallelism the head is sliced by vocabulary rows and each rank computes its own
logits only (training/vocab_parallel.py): no rank ever holds [rows, vocab].
"""

from __future__ import annotations

import torch

from polyrl.batch import MicroBatch
from polyrl.training import batch_invariant, fused_norm, moe_replay, vlm, vocab_parallel
from polyrl.training.ulysses import gather_shards, own_positions
from polyrl.training.varlen import packed_forward_kwargs, use_varlen_attention

FUSED_MIN_ELEMENTS = 1 << 28
"""Logits (response rows x vocab) from which a forward that will be differentiated takes the
chunked, recomputing path: 1 GiB of float32 (the plain path keeps ~3 such blocks alive). Below
it the plain path is faster on CPU, where the recomputed head matmul costs more than the memory
passes it saves. A size rule, never a run-time timing, so a run's numerics follow its shapes."""
FUSED_MIN_ELEMENTS_NO_GRAD = 1 << 24
"""The same under no_grad (reference / proximal log-probs): nothing is recomputed there, so the
fused path does the same matmul with fewer passes over the logits; from 64 MB of float32."""
CHUNK_ELEMENTS = 1 << 22
"""Logits per chunk (16 MB of float32: below glibc's mmap threshold, so chunk temporaries are
reused from the heap rather than faulted in)..."""
MIN_CHUNK_ROWS = 128
"""...but never fewer rows than this: each chunk re-reads the whole [vocab, hidden] head, and a
matmul with too few rows is bound by that read rather than by arithmetic."""


def response_logprobs(
    model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [b, R], entropy [b, R] or None) of `mb`'s response tokens under `model`.

    The entropy carries gradient only when `entropy_grad` (an entropy bonus in the loss).
    A model switched to the batch-invariant forward (`rollout.batch_invariant`) computes them
    with it (training/batch_invariant.py)."""
    images = getattr(mb, "images", None) is not None
    if batch_invariant.is_enabled(model):
        if images:
            raise ValueError("rollout.batch_invariant=true has no forward for images; set it to false")
        return batch_invariant.invariant_response_logprobs(model, mb, with_entropy, entropy_grad)
    kwargs = packed_forward_kwargs(mb)
    moe_replay.begin(model, mb)  # mixture-of-experts: the routes to replay (training/moe_replay.py)
    fused_norm.use_fused_rms_norm(model)  # RMSNorm as one autograd node (CPU, float32; training/fused_norm.py)
    if kwargs:  # a packed row with segment boundaries (polyrl/batch/packed.py)
        use_varlen_attention(model)
    elif getattr(mb, "position_ids", None) is not None:  # packed with a dense block-diagonal mask
        kwargs["position_ids"] = mb.position_ids
    if images or vlm.runs_tower_every_forward(model):  # the vision tower and M-RoPE (training/vlm.py)
        hidden = vlm.image_forward(model, mb, kwargs)
    else:
        hidden = model.base_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **kwargs).last_hidden_state
    moe_replay.end(model, mb)
    H = hidden.shape[-1]
    # gather_index indexes each row of a padded batch, or the single row of a packed one
    row_offset = 0 if hidden.shape[0] == 1 else torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1) * hidden.shape[1]
    head = model.get_output_embeddings()
    b, R = mb.target_ids.shape
    vocab = head.weight.shape[0]
    real = torch.arange(R, device=hidden.device).unsqueeze(0) < mb.response_lengths.to(hidden.device).unsqueeze(1)
    # sequence parallelism: this rank's hidden rows are a slice of the row, and it computes the
    # tokens read from there (the rest of the group computes the others; training/ulysses.py)
    index, real = own_positions(mb, mb.gather_index + row_offset, real)
    shard = vocab_parallel.vocab_shard(head.weight)
    if shard is not None:  # tensor parallelism: this rank's vocabulary rows only (training/vocab_parallel.py)
        picked = hidden.reshape(-1, H).index_select(0, index[real])  # [n, H]: real response rows
        lp, ent = vocab_parallel.vocab_parallel_logprobs(picked, shard, mb.target_ids[real],
                                                         with_entropy=with_entropy or entropy_grad)
        if ent is not None and not entropy_grad:
            ent = ent.detach()
        entropy = None if ent is None else ent.new_zeros(b, R).masked_scatter(real, ent)
        return gather_shards(mb, lp.new_zeros(b, R).masked_scatter(real, lp)), gather_shards(mb, entropy)
    threshold = FUSED_MIN_ELEMENTS if torch.is_grad_enabled() else FUSED_MIN_ELEMENTS_NO_GRAD
    if _fusable(head) and b * R * vocab >= threshold:
        # only real response rows: padding past a row's length gets 0 (masked everywhere anyway)
        picked = hidden.reshape(-1, H).index_select(0, index[real])  # [n, H]
        lp, ent = fused_logprobs(picked, head.weight, mb.target_ids[real],
                                 with_entropy=with_entropy or entropy_grad)
        logprobs = lp.new_zeros(b, R).masked_scatter(real, lp)
        entropy = None
        if ent is not None:
            if not entropy_grad:
                ent = ent.detach()
            entropy = ent.new_zeros(b, R).masked_scatter(real, ent)
        return gather_shards(mb, logprobs), gather_shards(mb, entropy)
    # A packed row mixes short and long samples, so most of its [b, R] is padding past each
    # sample's length: the head runs on its real rows only. A padded micro-batch (length-sorted,
    # little such padding) keeps [b, R], free of data-dependent shapes for actor.compile.
    compact = bool(kwargs)
    picked = hidden.reshape(-1, H)[index[real] if compact else index]  # [n, H] or [b, R, H]
    targets = mb.target_ids[real] if compact else mb.target_ids
    logits = head(picked).float()  # [..., V]
    logprobs, entropy = logits_logprobs(logits, targets, with_entropy=with_entropy, entropy_grad=entropy_grad)
    if compact:
        logprobs = logprobs.new_zeros(b, R).masked_scatter(real, logprobs)
        entropy = None if entropy is None else entropy.new_zeros(b, R).masked_scatter(real, entropy)
    return gather_shards(mb, logprobs), gather_shards(mb, entropy)


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True,
                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits [..., V], targets [...] -> (log p(target) [...], entropy [...] or None), the
    entropy with gradient only when `entropy_grad`. **Consumes `logits`**: their buffer is reused
    (the LM head's fresh output, which nothing else reads: a matmul's backward keeps its inputs).

    One autograd node (`_LogitsLogProbs`) in place of `log_softmax`, `gather` and the entropy's
    ops. On a CPU the [..., V] passes of this path cost more in fresh buffers (page faults, cold
    cache lines) than in arithmetic; autograd's ops write five such buffers per micro-batch (the
    log-softmax, its exp, their product, the gather's zero-filled gradient and the log-softmax's
    gradient, which takes the exp again), this writes one, the probabilities, whose buffer the
    backward turns into the logits' gradient (docs/moe.md "Speed"). Under torch.compile
    (`actor.compile`) autograd's ops run: inductor fuses them itself."""
    with_entropy = with_entropy or entropy_grad
    if torch.compiler.is_compiling():
        logp = torch.log_softmax(logits, dim=-1)
        logprob = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logprob, None
        entropy = -(logp.exp() * logp).sum(-1)
        return logprob, entropy if entropy_grad else entropy.detach()
    with torch.autocast(logits.device.type, enabled=False):  # float32 throughout (autocast would
        # run the entropy's row-wise dot product in its lower dtype)
        logprob, entropy, _ = _LogitsLogProbs.apply(logits, targets, with_entropy, entropy_grad)
    return logprob, entropy if with_entropy else None


class _LogitsLogProbs(torch.autograd.Function):
    """(log p(target), entropy or an empty tensor, the logits' buffer) of `logits_logprobs`; the
    third output is the consumed logits (autograd requires a tensor changed in place to be
    returned; it holds scratch and is dropped)."""

    @staticmethod
    def forward(ctx, logits, targets, with_entropy, entropy_grad):
        ctx.set_materialize_grads(False)
        p = torch.softmax(logits, dim=-1)
        # log-sum-exp without another exp pass: p's largest entry is exp(max - lse) = 1 / sum
        lse = logits.amax(-1, keepdim=True).sub_(p.amax(-1, keepdim=True).log_())
        logp = logits.sub_(lse)  # in place: the logits' buffer now holds log p
        ctx.mark_dirty(logits)
        logprob = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = logprob.new_empty(0)
        if with_entropy and entropy_grad:  # the backward reads log p: a temporary product
            entropy = torch.linalg.vecdot(p, logp).neg_()
            ctx.save_for_backward(p, targets, logp, entropy)
        else:
            if with_entropy:  # log p is not read again: the product in its buffer
                entropy = logp.mul_(p).sum(-1).neg_()
            ctx.save_for_backward(p, targets)
            ctx.mark_non_differentiable(entropy)
        ctx.entropy_grad, ctx.spent = entropy_grad, False
        return logprob, entropy, logits

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_scratch):
        if ctx.spent:
            raise RuntimeError("logits_logprobs: its backward turns the saved probabilities into the logits' "
                               "gradient, so it runs once per graph (retain_graph=True is not supported)")
        ctx.spent = True
        p, targets, *rest = ctx.saved_tensors
        if grad_logprob is None:
            grad_logprob = p.new_zeros(targets.shape)
        g = grad_logprob.unsqueeze(-1)
        if ctx.entropy_grad and grad_entropy is not None:
            logp, entropy = rest
            # d log p_t / dz = onehot_t - p;  d H / dz = -p (log p + H)
            grad = p.mul_((logp + entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(g)).neg_()
        else:
            grad = p.mul_(g.neg())
        grad.scatter_add_(-1, targets.unsqueeze(-1), g)
        return grad, None, None, None


def _fusable(head: torch.nn.Module) -> bool:
    """A plain bias-free Linear head (a LoRA-wrapped or biased head takes the plain path)."""
    return type(head) is torch.nn.Linear and head.bias is None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [n, H], head weight [V, H], targets [n] -> (log p(target) [n], entropy [n] or None),
    float32, without materialising more than one chunk of [rows, V] logits.

    Under autocast the head matmul runs in the autocast dtype (bf16 logits, as `Linear` would
    give) and everything after it in float32, like the plain path."""
    dtype = weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    rows = max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(weight.shape[0], 1))
    # autocast off inside: the function casts explicitly, and its backward must use the same dtype
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent = _FusedLogProbs.apply(hidden, weight, targets, dtype, rows, with_entropy)
    return lp, ent if with_entropy else None


def chunk_logit_grads(hidden: torch.Tensor, w: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                      grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None, rows: int):
    """The backward's chunks of `rows` rows: yields (s, e, h, g, gz) for rows [s, e), where h is
    the chunk's hidden [c, H] in w's dtype (the matmul dtype), g its log-probs' gradient [c] and
    gz the gradient of its logits [c, V] (float32, recomputed from h, w [V, H] and lse [n]) but for
    the target's one-hot term g, which the caller adds: it alone depends on who owns the target
    (the whole head here, one vocabulary slice in vocab_parallel.py)."""
    n = hidden.shape[0]
    if grad_logprob is None:
        grad_logprob = lse.new_zeros(n)
    use_ent = grad_entropy is not None and entropy.numel() == n
    for s in range(0, n, rows):
        e = min(s + rows, n)
        h = hidden[s:e].to(w.dtype)
        logp = (h @ w.t()).float().sub_(lse[s:e].unsqueeze(1))  # recomputed: [c, V]
        g = grad_logprob[s:e]
        p = logp.exp()
        # d logp_t / dz = onehot_t - p;  d entropy / dz = -p * (logp + entropy)
        if use_ent:
            coef = logp.add_(entropy[s:e].unsqueeze(1)).mul_(grad_entropy[s:e].unsqueeze(1)).add_(g.unsqueeze(1))
            gz = p.mul_(coef).neg_()
        else:
            gz = p.mul_(g.unsqueeze(1)).neg_()
        yield s, e, h, g, gz


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype, rows, with_entropy):
        w = weight.to(dtype)
        n = hidden.shape[0]
        lse = hidden.new_empty(n, dtype=torch.float32)
        logprob = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            z = (hidden[s:e].to(dtype) @ w.t()).float()  # [c, V]
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse[s:e].unsqueeze(1))  # in place: the chunk's only [c, V] float buffer
            logprob[s:e] = logp.gather(1, targets[s:e].unsqueeze(1)).squeeze(1)
            if with_entropy:
                entropy[s:e] = -(logp.exp().mul_(logp)).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.dtype, ctx.rows = dtype, rows
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        w = weight.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s, e, h, g, gz in chunk_logit_grads(hidden, w, lse, entropy, grad_logprob, grad_entropy, rows):
            gz.scatter_add_(1, targets[s:e].unsqueeze(1), g.unsqueeze(1))
            gz = gz.to(dtype)
            if need_h:
                grad_hidden[s:e] = gz @ w
            if need_w and gz.dtype == torch.float32:
                grad_w.addmm_(gz.t(), h)  # in place: no [V, H] temporary per chunk
            elif need_w:
                grad_w.add_(gz.t() @ h)  # a bf16 partial per chunk, accumulated in float32
        return (grad_hidden, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None)
