"""Expert parallelism for mixture-of-experts policies (`actor.expert_parallel_size`; docs/moe.md).

The `ep` ranks of one expert group are data-parallel ranks (they train different samples) that
split every MoE layer's experts: rank i of the group holds experts [i E/ep, (i+1) E/ep) of each
fused expert tensor (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]). A layer's forward:

1. the router (unchanged, routing replay included: training/moe_replay.py) picks each local
   token's top-k experts;
2. the (token, slot) pairs are sorted by expert and sent to the experts' owners
   (`all_to_all_single`, uneven splits; gloo implements it on CPU tensors);
3. each rank runs its own experts on what it received, sorted by expert: one grouped matmul per
   projection (`expert_mlp`, training/moe_experts.py, the forward of one rank's experts too);
4. the outputs go back by the reverse all-to-all, are weighted by the router's weights and
   summed per token in expert order (transformers' order, so one rank and ep ranks agree).

The all-to-all is its own autograd function whose backward is the reverse all-to-all: an
expert's gradient gathers the contributions of every rank's tokens, i.e. it is already summed
over the expert group, and FSDP2 sums it further over the remaining data ranks (`efsdp`).

Layout (torchtitan / verl): the ep axis subdivides the data-sharding axis dp_shard (training/
mesh.py `expert_group`, `expert_shard_group`). Non-expert parameters are sharded by FSDP2 over
all gradient ranks as before; each expert tensor is a DTensor `Shard(0)` on the `ep` dim of a 2-D
mesh (efsdp, ep) and FSDP2 shards its local experts over `efsdp`. Being DTensors of the full
[E, ...] shape, the gradient norm, DCP checkpoints and `full_tensor()` see the whole tensor; the
weight sync (`stream_pieces`) sends one expert at a time, each gathered from its owner, never
the whole fused tensor on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from polyrl.training.moe_experts import expert_mlp

MESH_DIMS = ("efsdp", "ep")
"""The 2-D mesh the expert tensors live on: FSDP2's shards of the local experts x the expert
group."""
_EXPERTS = ("Qwen3MoeExperts", "Qwen2MoeExperts")
_FUSED = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' fused expert collections (Qwen3-MoE, Qwen2-MoE) of `model`."""
    return [m for m in model.modules() if any(type(m).__name__.endswith(n) for n in _EXPERTS)
            or type(m).__name__.removeprefix("FSDP") in _EXPERTS]


def check_supported(ep: int, model: torch.nn.Module, refused: dict[str, bool]) -> list[torch.nn.Module]:
    """The expert modules to split over `ep` ranks; one line naming the key for what is not
    implemented with expert parallelism (`refused`: what -> present)."""
    for what, present in refused.items():
        if present:
            raise ValueError(f"actor.expert_parallel_size={ep} with {what} is not implemented; "
                             "set actor.expert_parallel_size=1")
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"actor.expert_parallel_size={ep}: {type(model).__name__} has no Qwen3-MoE / Qwen2-MoE "
                         "expert layers to split (docs/moe.md); set actor.expert_parallel_size=1")
    n = experts[0].num_experts
    if n % ep:
        raise ValueError(f"actor.expert_parallel_size={ep} does not divide the model's num_experts={n}; "
                         f"set it to a divisor of {n}")
    return experts


def device_mesh(dims: Any, rank: int, group: Any, device_type: str):
    """The (efsdp, ep) DeviceMesh of this rank over the trainer ranks (`group`; None: the
    world). Both dims' groups are created by their members only (mesh_groups.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    from polyrl.training import mesh_groups

    members = dist.get_process_group_ranks(group or dist.group.WORLD)

    def of(mesh_ranks: tuple[int, ...]):
        ranks = tuple(members[r] for r in mesh_ranks)
        # every trainer rank: the trainer group itself (see mesh_groups.mesh_groups `of`)
        return (group or dist.group.WORLD) if list(ranks) == members else mesh_groups._group(ranks)

    shard_ranks, ep_ranks = dims.expert_shard_group(rank), dims.expert_group(rank)
    # the same order on every rank: the efsdp group, then the ep group
    shard, ep = of(shard_ranks), of(ep_ranks)
    layout = torch.tensor([[members[r] for r in dims.expert_group(s)] for s in shard_ranks], dtype=torch.int)
    return DeviceMesh.from_group([shard, ep], device_type, mesh=layout, mesh_dim_names=MESH_DIMS)


def split_experts(experts: list[torch.nn.Module], mesh2d) -> None:
    """Keep this rank's experts of every fused tensor as a DTensor Shard(0) on the ep dim (the
    model was loaded whole on every rank, the same on each, or is still on the meta device, to
    be read by experts: training/sharded_load.py) and route the forward through the all-to-all
    (`_forward`)."""
    import types

    ep_mesh = mesh2d["ep"]
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in experts:
        per = module.num_experts // ep
        for name in _FUSED:
            full = getattr(module, name)
            local = full.detach()[me * per:(me + 1) * per].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, torch.nn.Parameter(dt, requires_grad=full.requires_grad))
        module._polyrl_ep = (ep_mesh.get_group(), ep, me, per)
        module.forward = types.MethodType(_forward, module)


def is_expert_param(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == MESH_DIMS


def expert_pieces(p: DTensor) -> tuple[int, ...]:
    """Row boundaries of a fused expert tensor's stream: one expert per piece."""
    return tuple(range(p.shape[0] + 1))


def stream_pieces(p: DTensor, device: torch.device) -> Iterator[torch.Tensor]:
    """Each expert of `p` whole, one at a time, on every rank: its owner's efsdp group gathers
    its rows (fsdp2._gather_local_rows), then the owner broadcasts them over the ep group. A rank
    holds one expert's rows beyond its shards, never the fused tensor."""
    mesh = p.device_mesh
    shard_group, ep_group = mesh.get_group("efsdp"), mesh.get_group("ep")
    ep, me = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    per = p.shape[0] // ep
    local = p.to_local()
    for e in range(p.shape[0]):
        owner = e // per
        if owner == me:
            row = _shard_row(local, per, e - me * per, shard_group, device)
        else:
            row = torch.empty((1, *p.shape[1:]), dtype=p.dtype, device=device)
        dist.broadcast(row, src=dist.get_global_rank(ep_group, owner), group=ep_group)
        yield row


def _shard_row(local: torch.Tensor, rows: int, row: int, group, device: torch.device) -> torch.Tensor:
    """Row `row` of a tensor of `rows` rows that FSDP2 shards over `group` as torch.chunk does
    (`local`: this rank's rows), as a [1, ...] tensor on every rank of `group`: its holder
    broadcasts it."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    if ranks == 1:
        return local[row:row + 1].detach().to(device).contiguous()
    chunk = -(-rows // ranks)
    holder = row // chunk
    out = (local[row - me * chunk:row - me * chunk + 1].detach().to(device).contiguous() if holder == me
           else torch.empty((1, *local.shape[1:]), dtype=local.dtype, device=device))
    dist.broadcast(out, src=dist.get_global_rank(group, holder), group=group)
    return out


def shard_experts(engine: Any, model: torch.nn.Module, device: torch.device, fsdp_kwargs: dict):
    """fsdp2 (training/fsdp2.py), before its per-layer sharding: split every expert layer of
    `engine`'s model over the ep ranks, then shard each rank's experts over the efsdp ranks.
    Returns the (efsdp, ep) mesh."""
    from dataclasses import replace

    from torch.distributed.fsdp import fully_shard

    from polyrl.training import batch_invariant

    ep = engine.cfg.expert_parallel_size
    experts = check_supported(ep, engine.module, {
        "model.lora_rank > 0 (LoRA)": engine.lora,
        "rollout.batch_invariant=true": batch_invariant.is_enabled(engine.module),
        "actor.offload=true": engine.cfg.offload,
        "actor.tensor_parallel_size > 1": engine.mesh.tensor is not None})
    dims = replace(engine.mesh.dims, ep=ep)  # checks that ep divides the data-sharding ranks
    # a deferred model (on the meta device) is split there: the fsdp2 engine's sharded read then
    # gives each rank its own experts' rows only (sharded_load.FusedExperts)
    mesh2d = device_mesh(dims, engine.mesh.rank, engine.gradient_group, device.type)
    split_experts(experts, mesh2d)
    kwargs = {**fsdp_kwargs, "mesh": mesh2d["efsdp"]}
    for module in experts:
        fully_shard(module, **kwargs)
    return mesh2d


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `*MoeExperts.forward` with the experts split over the ep group (module doc)."""
    group, ep, _, per = self._polyrl_ep
    w_gate_up, w_down = self.gate_up_proj, self.down_proj
    w_gate_up = w_gate_up.to_local() if isinstance(w_gate_up, DTensor) else w_gate_up  # [per, 2I, H]
    w_down = w_down.to_local() if isinstance(w_down, DTensor) else w_down  # [per, H, I]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, tokens ascending
    token = order // k
    counts = torch.bincount(flat, minlength=self.num_experts).view(ep, per)  # [owner, its expert]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source, my expert]
    send = counts.sum(1).tolist()
    recv = received.sum(1).tolist()
    x = _AllToAll.apply(hidden_states[token], recv, send, group)
    # what arrived is by source rank, then expert: regroup by expert (stable: sources ascending)
    local_expert = torch.repeat_interleave(torch.arange(per).repeat(ep), received.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    x = x[by_expert]
    # this rank's experts on their rows (training/moe_experts.py: one grouped matmul per
    # projection). With nothing arrived it stays in the graph, so this rank's backward runs both
    # exchanges too and its experts get a (zero) gradient like their shards' on the other efsdp ranks
    y = expert_mlp(x, received.sum(0).tolist(), w_gate_up, w_down, self.act_fn)
    y = y[torch.argsort(by_expert)]  # back to the arrival order
    y = _AllToAll.apply(y, send, recv, group)  # back to the tokens' ranks, in `order`
    y = y * top_k_weights.reshape(-1)[order, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, y.to(out.dtype))
