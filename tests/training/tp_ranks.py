"""What one rank of a tensor-parallel test runs (imported by the gloo ranks of gloo_world.py):
the fixed batches of engine_ranks.py, each rank training on its data shard (the ranks of one tp
group on the same one), with log-probs and entropies before training and a weight sync after."""

from __future__ import annotations

import weakref

import torch

import engine_ranks
from polyrl.batch import Ragged, scatter_rows, shard
from polyrl.training.mesh import ParallelDims


ADAM_EPS = 1e-5
"""AdamW's epsilon in these runs: its step is lr * g / (|g| + eps), so a gradient element that is
~0 (Qwen3's k_proj behind its k_norm has many) turns summation-order noise into up to lr / eps
times as much movement; at the default 1e-8 that is 1e5, at 1e-5 it is 100, and the weights
after training compare at 1e-5 as the log-probs, losses and gradient norms do."""


def run(rank: int, world_size: int, model_path: str, tp: int, strategy: str = "fsdp2",
        batches=engine_ranks.BATCHES, extras: bool = False, sp: int = 1) -> dict:
    cfg = engine_ranks.actor_config(strategy, world_size=world_size, tensor_parallel_size=tp, eps=ADAM_EPS,
                                    sequence_parallel_size=sp)
    dims = ParallelDims.from_actor(cfg)
    engine, actor = engine_ranks.build(model_path, cfg, rank, world_size)

    def mine(seed: int, n: int):
        return shard(engine_ranks.make_batch(seed, n), dims.data_parallel_size)[dims.data_rank(rank)]

    out: dict = {"dims": dims.describe(), "data_rank": dims.data_rank(rank), "metrics": []}
    probe = engine_ranks.make_batch(5, 5)  # the whole batch on every rank: comparable to one rank
    out["logprobs"] = engine.logprobs(probe).values
    # entropy with its gradient (the forward the entropy bonus differentiates) of every response
    # token, put in place by sample: the same whether the engine padded or packed (sp) its rows
    entropy = Ragged.full_like(probe.response_ids, 0.0, torch.float32)
    for i, mb in enumerate(engine.micro_batches(probe)):
        shard_ = getattr(mb, "sequence_shard", None)  # sequence parallelism: this rank's slice of the row
        if i == 0:
            out["token_slice"] = None if shard_ is None else (shard_.start, shard_.end, int(mb.input_ids.shape[1]))
        lp, ent = engine.forward(mb, with_entropy=True, entropy_grad=True)
        scatter_rows(entropy, mb, ent.detach().float().cpu())
        (ent.sum() * 0.0).backward()  # a zero-loss backward: every rank moves the same collectives
    out["entropy"] = entropy.values
    engine.model.zero_grad(set_to_none=True)
    for seed, n in batches:
        m = actor.update(mine(seed, n), num_mini_batches=1, use_rollout_logprobs=False)
        out["metrics"].append({k: m[k] for k in engine_ranks.SHARE_KEYS})
    # weight sync: full tensors one at a time; how many are alive at once when none is kept
    out["weights"], out["live_peak"] = gathered_weights(engine)
    weights = out["weights"]
    out["specs_match"] = [(n, tuple(w.shape), w.dtype) for n, w in weights.items()] == [
        (n, tuple(s), d) for n, s, d in engine.weight_specs()]
    # the stream a transport sends, with buckets of 2 KiB: a bigger parameter comes in row slices,
    # each gathered on its own (over the shard ranks, then put together over the tp ranks)
    if hasattr(engine, "piece_bytes"):
        engine.piece_bytes = 2048
        stream = engine.weight_stream()
        rows: dict[str, list[torch.Tensor]] = {}
        largest = 0
        for name, piece in stream.pieces():
            rows.setdefault(name, []).append(piece.clone())
            largest = max(largest, piece.nbytes)
        out["sliced"] = sum(len(s.pieces) > 0 for s in stream.specs)
        out["largest_piece"] = largest
        out["streamed"] = {name: torch.cat(parts) for name, parts in rows.items()}
    if extras:  # the frozen reference and a critic on the same mesh
        # built on the meta device and read from the files, as PolicyWorker loads fsdp2's reference
        reference = _deferred_reference(model_path, cfg, rank, world_size)
        out["reference"] = reference.logprobs(probe).values
        out["reference_trainable"] = sum(p.requires_grad for p in reference.model.parameters())
        out["critic"] = critic_updates(rank, world_size, model_path, tp, strategy, sp)
    out["param_bytes"] = engine.state_bytes()["params"] if hasattr(engine, "state_bytes") else None
    return out


def one_rank(model_path: str, extras: bool = False) -> dict:
    """The reference: one rank, ddp, in this process."""
    return run(0, 1, model_path, tp=1, strategy="ddp", extras=extras)


def _deferred_reference(model_path: str, cfg, rank: int, world_size: int):
    import torch.distributed as dist

    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.training.model_loading import load_causal_lm

    model = load_causal_lm(model_path, cfg.param_dtype, deferred=cfg.strategy == "fsdp2")
    assert sharded_load.is_deferred(model) == (cfg.strategy == "fsdp2")
    platform = get_platform("cpu")
    return build_engine(model, cfg, platform, platform.torch_device(0), rank=rank, world_size=world_size,
                        group=dist.group.WORLD if dist.is_initialized() else None, horizon=None)


def critic_updates(rank: int, world_size: int, model_path: str, tp: int, strategy: str, sp: int = 1) -> list[dict]:
    """engine_ranks.critic_updates on the tp mesh: the value head (a one-output Linear, in no
    plan) whole on every rank over the sliced trunk."""
    cfg = engine_ranks.actor_config(strategy, ppo_epochs=1, world_size=world_size, tensor_parallel_size=tp,
                                    eps=ADAM_EPS, sequence_parallel_size=sp)
    dims = ParallelDims.from_actor(cfg)
    return engine_ranks.train_critic(cfg, model_path, rank, world_size, dp=dims.data_parallel_size,
                                     data_rank=dims.data_rank(rank))


def gathered_weights(engine) -> tuple[dict, int]:
    """The engine's weight stream copied, and the most of its tensors alive at once while it
    streams (1: gathered one parameter at a time, never the whole model)."""
    refs, live_peak, weights = [], 0, {}
    for name, t in engine.named_weights():
        weights[name] = t.detach().clone()
        refs.append(weakref.ref(t))
        live_peak = max(live_peak, sum(r() is not None for r in refs))
        del t
    return weights, live_peak
