"""Rollout routing replay for mixture-of-experts policies (`actor.router_replay`; docs/moe.md).

The engine and the trainer can pick different experts for the same token: a tiny numeric
difference flips a top-k. Replay makes the trainer use the routes the engine used (R3, the
batch's routes column, polyrl/batch/routes.py) or the routes of the trainer's own old-policy
forward (R2). The router still computes its scores; only the top-k choice is replaced, and the
weights become `probs.gather(-1, replayed_ids)`, so the router keeps its gradient.

`RouterReplay.install(model)` rebinds the forward of each Qwen3-MoE / Qwen2-MoE router
(transformers' `*TopKRouter`: `weight`, `top_k`, `norm_topk_prob`); with nothing to replay it
computes exactly what transformers computes. The head (training/logprobs.py) calls `begin(mb)`
before each micro-batch's forward: the replay tensor stays set until the next micro-batch, so the
recompute of gradient checkpointing (inside backward) routes as the forward did. Tokens marked -1
(prompt positions, padding, tokens the engine did not route) are routed by the trainer.

Measured on the way, every forward: the share of replayed (token, layer) top-k sets the trainer's
own router agrees with (`moe/route_match`), and the most-loaded expert's share of the token-slots
(`moe/expert_load_max`, averaged over layers); with `actor.router_aux_loss_coef` > 0 the
Switch-style load-balancing loss E * sum_e f_e * P_e, averaged over layers (`aux_loss`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ATTR = "_polyrl_router_replay"


def is_router(module: torch.nn.Module) -> bool:
    """transformers' top-k router of a Qwen3-MoE / Qwen2-MoE sparse block."""
    return type(module).__name__ in ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")


def has_routers(model: torch.nn.Module) -> bool:
    return any(is_router(m) for m in model.modules())


class RouterReplay:
    def __init__(self, routers: list[torch.nn.Module], mode: str):
        self.routers, self.mode = routers, mode
        self.num_experts = routers[0].num_experts
        self.replay: torch.Tensor | None = None
        """[N, layers, k] int64 ids for the current micro-batch's flattened tokens (-1: own)."""
        self.valid: torch.Tensor | None = None
        """[N] bool: real tokens (padding excluded) of the current micro-batch."""
        self.sp_group: Any = None
        """Under sequence parallelism, the sp group whose ranks hold the rest of the row: the
        expert load and the load-balancing loss are the whole row's."""
        self.record_into: Any = None
        """A routes Ragged shaped like the batch's responses: R2's old-policy forward writes the
        trainer's own routes there (`record`)."""
        self._routed: list[torch.Tensor | None] = [None] * len(routers)
        self._layer_stats: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * len(routers)
        self.aux: list[torch.Tensor] = []
        self.reset_metrics()

    @classmethod
    def install(cls, model: torch.nn.Module, mode: str) -> RouterReplay | None:
        """Rebind `model`'s routers (None for a model without any, where `mode` must be off)."""
        routers = [m for m in model.modules() if is_router(m)]
        if not routers:
            if mode != "off":
                raise ValueError(f"actor.router_replay={mode}: the policy has no Qwen3-MoE / Qwen2-MoE router to "
                                 "replay (docs/moe.md); set actor.router_replay=off")
            return None
        replay = cls(routers, mode)
        for i, router in enumerate(routers):
            router._polyrl_layer = i
            router._polyrl_state = replay
            router.forward = types.MethodType(_router_forward, router)
        setattr(model, _ATTR, replay)
        return replay

    # -- per micro-batch --------------------------------------------------------------------------

    def begin(self, mb: Any) -> None:
        self._commit()
        routes = getattr(mb, "routes", None)  # off: compared with, never replayed
        self.replay = None if routes is None else routes.reshape(-1, *routes.shape[2:])
        mask = mb.attention_mask
        self.valid = mask.reshape(-1).bool() if mask is not None and mask.dim() == 2 else None
        shard = getattr(mb, "sequence_shard", None)
        self.sp_group = None if shard is None else shard.sp.group
        if shard is not None:  # sequence parallelism: this rank's slice, the row's padding excluded
            self.valid = torch.arange(shard.start, shard.end) < shard.tokens
        self.aux = []

    def _commit(self) -> None:
        """Add the finished micro-batch's per-layer statistics (a recompute overwrote them with
        the same numbers) to the totals."""
        for match, compared, load in self._layer_stats:
            self.match += match
            self.compared += compared
            if load:
                self.load_sum += load
                self.load_count += 1
        self._layer_stats = [(0.0, 0.0, 0.0)] * len(self.routers)

    def routed(self, layer: int, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The ids the router uses: its own top-k `ids` [N, k], or the replayed ones."""
        own = ids
        match = compared = 0.0
        if self.replay is not None:
            if self.replay.shape[0] != ids.shape[0]:
                raise ValueError(f"actor.router_replay: {self.replay.shape[0]} replayed tokens for a forward of "
                                 f"{ids.shape[0]}: the routes were not laid out like the micro-batch's tokens")
            replay = self.replay[:, layer].to(ids.device)
            use = replay[:, 0] >= 0
            if bool(use.any()):
                same = (own.sort(-1).values == replay.sort(-1).values).all(-1) & use
                match, compared = float(same.sum()), float(use.sum())
                if self.mode != "off":  # off: the agreement is measured, the router keeps its own
                    ids = torch.where(use[:, None], replay, own)
        valid = self.valid.to(ids.device) if self.valid is not None and len(self.valid) == len(ids) else None
        chosen = ids if valid is None else ids[valid]
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float()
        tokens = float(len(chosen))
        if self.sp_group is not None:  # sequence parallelism: the whole row's counts (every sp rank calls)
            both = torch.cat([counts, counts.new_tensor([tokens])])
            dist.all_reduce(both, group=self.sp_group)
            counts, tokens = both[:-1], float(both[-1])
        load = 0.0
        if tokens:
            slots = tokens * ids.shape[-1]
            load = float(counts.max() / slots)
            if torch.is_grad_enabled() and probs.requires_grad:
                share = counts / slots  # f_e, no gradient
                # P_e; under sequence parallelism this slice's part of the row's mean: the sp ranks'
                # gradients sum to the whole row's
                mean_prob = (probs if valid is None else probs[valid]).sum(0) / tokens
                self.aux.append(self.num_experts * (share * mean_prob).sum())
        self._layer_stats[layer] = (match, compared, load)
        self._routed[layer] = ids.detach()
        return ids

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward, averaged over layers (None: no gradient)."""
        return torch.stack(self.aux).mean() if self.aux else None

    # -- R2: recording the trainer's own routes ---------------------------------------------------

    def record(self, mb: Any) -> None:
        """After a forward: the trainer's routes of each response token fed as input, written
        into `record_into` at the micro-batch's rows (the last token, never fed, stays unmarked)."""
        if self.record_into is None or any(r is None for r in self._routed):
            return
        ids = torch.stack(self._routed, 1)  # [N, layers, k] on the model's device
        rows, width = mb.input_ids.shape
        shard = getattr(mb, "sequence_shard", None)
        if shard is not None:  # sequence parallelism: the sp group's slices make the whole row
            ids, width = _gather_slices(ids, shard), shard.tokens  # (on the device: NCCL's group)
        ids = ids.cpu()
        b, R = mb.gather_index.shape
        j = torch.arange(R).unsqueeze(0)
        fed = j < (mb.response_lengths.unsqueeze(1) - 1)  # token j is an input when j < len - 1
        row = torch.arange(b).unsqueeze(1) if rows == b else torch.zeros(b, 1, dtype=torch.long)
        flat = (row * width + mb.gather_index.cpu() + 1)[fed]
        starts = self.record_into.offsets[:-1][mb.indices.cpu()]
        dest = (starts.unsqueeze(1) + j)[fed]
        self.record_into.values[dest] = ids[flat].to(self.record_into.values.dtype)

    # -- metrics -----------------------------------------------------------------------------------

    def reset_metrics(self) -> None:
        """Forget every forward so far, the last micro-batch's uncommitted statistics included."""
        self.match = self.compared = self.load_sum = 0.0
        self.load_count = 0
        self._layer_stats = [(0.0, 0.0, 0.0)] * len(self.routers)

    def empty_routes(self, response_ids: Any) -> Any:
        """A routes column shaped like `response_ids`, every token unmarked (R2 fills it)."""
        from polyrl.batch.ragged import Ragged
        from polyrl.batch.routes import encode, routes_dtype

        values = encode(None, len(response_ids.values), routes_dtype(self.num_experts), len(self.routers),
                        self.routers[0].top_k)
        return Ragged(values, response_ids.offsets)

    def metrics(self, engine: Any = None) -> dict[str, float]:
        """Since the last reset, summed over the ranks of `engine` (every rank calls this once per
        update), sp ranks included: `moe/expert_load_max`, and `moe/route_match` where the batch
        had routes."""
        self._commit()
        sums = torch.tensor([self.match, self.compared, self.load_sum, float(self.load_count)], dtype=torch.float64)
        if engine is not None and getattr(engine, "world_size", 1) > 1:
            sums = engine.all_reduce(sums)
        sp = getattr(engine, "sp", None)
        if sp is not None:  # the engine reduces over the data ranks; each sp rank routed a slice
            sums = sums.to(self.routers[0].weight.device)
            dist.all_reduce(sums, group=sp.group)
            sums = sums.cpu()
        match, compared, load_sum, load_count = sums.tolist()
        out = {}
        if load_count:
            out["moe/expert_load_max"] = load_sum / load_count
        if compared:
            out["moe/route_match"] = match / compared
        self.reset_metrics()
        return out


def _gather_slices(ids: torch.Tensor, shard: Any) -> torch.Tensor:
    """The packed row's routes [tokens, layers, k] from each sp rank's slice of it (equal slices,
    in rank order; training/ulysses.py), the padding past the row's real tokens dropped."""
    parts = [torch.empty_like(ids) for _ in range(shard.sp.size)]
    dist.all_gather(parts, ids.contiguous(), group=shard.sp.group)
    return torch.cat(parts)[: shard.tokens]


def replay_of(model: torch.nn.Module) -> RouterReplay | None:
    return getattr(model, _ATTR, None)


def _router_forward(self, hidden_states: torch.Tensor):
    """transformers' top-k router with the top-k choice open to replay (see the module doc)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    _, ids = torch.topk(probs, self.top_k, dim=-1)
    ids = self._polyrl_state.routed(self._polyrl_layer, ids, probs)
    top = probs.gather(-1, ids)  # without replay: exactly the top-k values
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), ids


def begin(model: torch.nn.Module, mb: Any) -> None:
    """Before a micro-batch's forward (training/logprobs.py): set what its routers replay."""
    replay = replay_of(model)
    if replay is not None:
        replay.begin(mb)


def end(model: torch.nn.Module, mb: Any) -> None:
    """After it: R2's old-policy forward records the trainer's routes."""
    replay = replay_of(model)
    if replay is not None:
        replay.record(mb)
