"""Variable-length attention for packed micro-batches (polyrl/batch/packed.py).

A packed micro-batch is one row of several samples back to back, with `cu_seq_lens_q/k` (the
sample boundaries, FlashAttention's varlen convention) and position ids restarting per sample.
`varlen_attention_forward` runs causal SDPA on each sample's segment of the row (samples of
similar length right-padded into one batched call), so no score is ever computed across samples
and attention costs about sum(L_i^2) rather than the T^2 of a dense block-diagonal mask (which made packing 0.6x of the padded path on CPU, docs/benchmarks.md
"Sequence packing").

It is registered in transformers' attention-function registry under `VARLEN_ATTENTION`, with a
mask function that builds no [T, T] mask for such calls. A call without segment boundaries (the
padded path, generation with a cache) goes to transformers' own SDPA function with the mask
transformers builds for SDPA, so a model switched to it computes exactly what "sdpa" computes
everywhere else. That is why the switch is made once for the model (`use_varlen_attention`) and
not around each forward: with gradient checkpointing a layer's forward runs again inside the
backward, outside any forward-scoped switch, and must still see the packed attention. The name
never reaches a checkpoint (transformers does not serialise `_attn_implementation`; tested).

Not wired: FlashAttention's varlen kernel on GPUs (transformers' "flash_attention_2" path with
cu_seqlens). The per-segment SDPA here runs on any device, but a GPU would want that kernel; no
GPU nor flash-attn was available to test it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.training.ulysses import ulysses_attention

VARLEN_ATTENTION = "polyrl_varlen"
"""The attention implementation name of a model switched by `use_varlen_attention`."""

_registered = False


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                             cu_seq_lens_k: torch.Tensor | None = None, sequence_shard=None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [b, Hq, T, D], key / value [b, Hkv, T, D]
    -> ([b, T, Hq, D], None). `sequence_shard` (sequence parallelism): the inputs hold this rank's
    slice of the row's tokens; the attention runs over the whole row (training/ulysses.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sequence_shard is not None:
        return ulysses_attention(varlen_attention_forward, module, query, key, value, attention_mask,
                                 sequence_shard, dropout=dropout, scaling=scaling, cu_seq_lens_q=cu_seq_lens_q,
                                 cu_seq_lens_k=cu_seq_lens_k, **kwargs)

    if cu_seq_lens_q is None and attention_mask is None:
        cu_seq_lens_q = _remembered(_boundaries_from_positions, kwargs.get("position_ids"), query.shape[0])
        cu_seq_lens_k = cu_seq_lens_q
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"packed attention supports one row of full causal self-attention; this layer has "
                         f"{unsupported or 'a batch or a cache'}: set actor.packing=off for this model")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("packed attention: key and query segments differ (cu_seq_lens_k != cu_seq_lens_q)")
    gather, scatter, shapes = _remembered(_plan_of, cu_seq_lens_q, query.device)
    gqa = key.shape[1] != query.shape[1]
    # [1, H, T, D] -> [H, P, D]: every bucket's segments right-padded to the bucket's length, P
    # positions in all (index_select: its backward is one scatter-add, not a full-row gradient
    # per segment)
    q, k, v = (x[0].index_select(1, gather) for x in (query, key, value))
    outs, start = [], 0
    for count, length in shapes:
        part = slice(start, start + count * length)
        start += count * length
        q_b, k_b, v_b = (x[:, part].unflatten(1, (count, length)).transpose(0, 1) for x in (q, k, v))
        # causal within each segment; a segment's padding sits after all its real tokens, so no
        # real query attends it (its outputs are dropped below)
        o = F.scaled_dot_product_attention(q_b, k_b, v_b, dropout_p=dropout, is_causal=True, scale=scaling,
                                           enable_gqa=gqa)  # [count, Hq, length, D]
        outs.append(o.transpose(0, 1).flatten(1, 2))
    out = torch.cat(outs, 1).index_select(1, scatter)  # [Hq, T, D], real positions in row order
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


_last: dict = {}
"""Per function, its last (argument tensor, other arguments, result): every attention layer of a
forward (and a checkpointed layer's recomputation) gets the same boundary / position tensor, so
the plan, which waits for the tensor's values, is made once per micro-batch, not once per layer.
The tensor itself is the key (held, so its identity cannot be reused)."""


def _remembered(fn, tensor: torch.Tensor | None, *args):
    if tensor is None:
        return fn(tensor, *args)
    last = _last.get(fn)
    if last is None or last[0] is not tensor or last[1] != args:
        last = _last[fn] = (tensor, args, fn(tensor, *args))
    return last[2]


def _plan_of(cu_seq_lens: torch.Tensor, device: torch.device):
    return _bucket_plan(cu_seq_lens.tolist(), device)


def _bucket_plan(bounds: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Segments [bounds[i], bounds[i+1]) grouped into buckets of similar length, so attention is
    a few batched SDPA calls rather than one per sample (a training pass of the 30M benchmark
    model 7% faster in fp32, 20% in bf16; docs/benchmarks.md "Sequence packing"). A segment's
    bucket length is its length rounded up to a quarter of its power of two, at least to a
    multiple of 8 (padding adds at most 25% to a segment of 32 tokens or more).

    Returns (gather [P]: the row position of each padded slot, a segment's last token repeated
    in its padding; scatter [T]: the padded slot of each row position; [(segments, length)] per
    bucket)."""
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n == 0:  # an empty sample attends nothing
            continue
        step = max(8, 1 << max(n.bit_length() - 3, 0))
        buckets.setdefault(-(-n // step) * step, []).append(i)
    gather, scatter, shapes, slot = [], [0] * bounds[-1], [], 0
    for length, members in sorted(buckets.items()):
        for i in members:
            s, n = starts[i], lengths[i]
            gather.extend(range(s, s + n))
            gather.extend([s + n - 1] * (length - n))
            scatter[s:s + n] = range(slot, slot + n)
            slot += length
        shapes.append((len(members), length))
    as_index = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return as_index(gather), as_index(scatter), shapes


def _boundaries_from_positions(position_ids: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """cu_seqlens of a packed row given only its restarting position ids (how transformers' flash
    path reads packing), None when they do not restart: a caller that packs without boundaries
    still never attends across samples."""
    if position_ids is None or rows != 1:
        return None
    pos = position_ids.reshape(-1)
    starts = ((pos.diff() != 1).nonzero().flatten() + 1).tolist()
    if not starts:
        return None
    return torch.tensor([0, *starts, pos.numel()], dtype=torch.int32, device=pos.device)


def varlen_mask(*, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                use_vmap: bool = False, **kwargs) -> torch.Tensor | None:
    """transformers' mask-function signature. No mask where the attention function applies
    causality itself (no padding mask, no cache offset, no sliding window, no custom mask
    function): there transformers would build the dense [T, T] block-diagonal mask of a packed
    row. Anything else gets SDPA's mask."""
    from transformers.masking_utils import sdpa_mask

    if (attention_mask is None and local_size is None and not use_vmap and q_length == kv_length
            and q_offset == 0 and kv_offset == 0):
        return None
    return sdpa_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap, **kwargs)


def register() -> None:
    """Add `VARLEN_ATTENTION` to transformers' attention and mask registries (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
        AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)
        _registered = True


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model using "sdpa") to the packed attention, once: packed
    micro-batches then run per-sample attention, everything else still runs SDPA."""
    config = model.config
    if config._attn_implementation == VARLEN_ATTENTION:
        return
    if config._attn_implementation != "sdpa":
        raise ValueError(f"actor.packing: packed micro-batches need the model's attention to be sdpa "
                         f"(it is {config._attn_implementation!r}); set actor.packing=off")
    register()
    model.set_attn_implementation(VARLEN_ATTENTION)


def setup_packing(model: torch.nn.Module, setting: str, *, head_reads_packed: bool, compiled: bool) -> str:
    """`actor.packing` resolved for one training engine ("auto", "on" or "off"), switching
    `model` to the packed attention unless off. Off for a head that reads padded rows only (a
    critic's values, polyrl/training/values.py) and, under auto, for a compiled forward (the
    per-sample loop would recompile for every pack) or a model whose attention the packed path
    does not compute (not sdpa, a sliding window, soft-capped logits)."""
    if setting == "off" or not head_reads_packed:
        return "off"
    config = model.config
    blockers = [why for why, present in (
        ("actor.compile runs the forward compiled", compiled),
        (f"the model's attention is {config._attn_implementation!r}, not sdpa",
         config._attn_implementation not in ("sdpa", VARLEN_ATTENTION)),
        ("the model has sliding-window layers",
         getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)),
        ("the model soft-caps attention logits", getattr(config, "attn_logit_softcapping", None) is not None),
    ) if present]
    if blockers and setting == "on":
        raise ValueError(f"actor.packing=on: {'; '.join(blockers)}; set actor.packing=auto or off")
    if blockers:
        return "off"
    use_varlen_attention(model)
    return setting


def packed_forward_kwargs(mb) -> dict:
    """The model-forward keyword arguments of a micro-batch: position ids and segment boundaries
    of a packed one (transformers passes them down to every attention call, and replays them in a
    checkpointed layer's recomputation), plus its sequence shard under sequence parallelism; none
    of a padded one."""
    if getattr(mb, "cu_seq_lens", None) is None:
        return {}
    kwargs = {"position_ids": mb.position_ids, "cu_seq_lens_q": mb.cu_seq_lens, "cu_seq_lens_k": mb.cu_seq_lens}
    if getattr(mb, "sequence_shard", None) is not None:  # this rank's slice (training/ulysses.py)
        kwargs["sequence_shard"] = mb.sequence_shard
    return kwargs
