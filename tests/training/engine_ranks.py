"""What one rank of a training-engine test runs (imported by the gloo ranks of gloo_world.py).

A fixed hand-built RolloutBatch, sharded over the ranks the way the trainer shards it
(polyrl.batch.shard), trained with the real PPOActor through `build_engine`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from polyrl.algorithms import AlgorithmConfig
from polyrl.algorithms.off_policy import OffPolicyConfig
from polyrl.batch import Ragged, RolloutBatch, plan_micro_batches, shard
from polyrl.platform import get_platform
from polyrl.training import build_engine
from polyrl.workers.actor import PPOActor
from polyrl.training.config import ActorConfig
from polyrl.training.model_loading import load_causal_lm

SHARE_KEYS = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/nonfinite_skipped")
"""Metrics that are global by construction (the per-token local means are averaged over ranks)."""


def make_batch(seed: int, n: int = 7, vocab: int = 128) -> RolloutBatch:
    """`n` samples of different prompt / response lengths, random tokens, advantages and
    rollout log-probs; a hole in one loss mask."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(4, 24, (n,), generator=g).tolist()
    R = torch.randint(1, 30, (n,), generator=g).tolist()
    prompts = Ragged.from_rows([torch.randint(2, vocab, (p,), generator=g) for p in P], torch.long)
    responses = Ragged.from_rows([torch.randint(2, vocab, (r,), generator=g) for r in R], torch.long)
    mask = Ragged.full_like(responses, 1.0, torch.float32)
    mask.values[1] = 0.0  # a token the policy did not sample
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=prompts, response_ids=responses, loss_mask=mask, group=torch.arange(n) // 2,
        stop_reason=zeros, finished_with_eos=torch.ones(n, dtype=torch.bool), weight_version=zeros,
        min_version=zeros, max_version=zeros, continuations=zeros,
        rollout_logprobs=responses.with_values(-torch.rand(len(responses.values), generator=g) * 3),
        advantages=torch.randn(n, generator=g))


def actor_config(strategy: str, **overrides) -> ActorConfig:
    # a tiny token budget: several micro-batches per rank, and different counts on each rank
    fields = dict(strategy=strategy, lr=1e-3, micro_batch_tokens=64, ppo_epochs=2, grad_clip=0.5)
    return ActorConfig(**{**fields, **overrides})


def build(model_path: str, cfg: ActorConfig, rank: int, world_size: int, horizon: int | None = 8):
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    model = load_causal_lm(model_path, cfg.param_dtype).to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                          group=dist.group.WORLD if dist.is_initialized() else None, horizon=horizon)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.named_weights()}


BATCHES = ((1, 7), (2, 7), (3, 1))
"""(seed, samples) of each update: 7 samples split 4 / 3 over two ranks, then 1 (rank 1 idle)."""


def train(rank: int, world_size: int, model_path: str, strategy: str, batches=BATCHES,
          overrides: dict | None = None) -> dict:
    """One update (`ppo_epochs`=2 optimizer steps) per fixed batch; the metrics of each update,
    the micro-batches each rank ran, and the final full weights."""
    cfg = actor_config(strategy, **(overrides or {}))
    engine, actor = build(model_path, cfg, rank, world_size)
    metrics, micro = [], []
    for seed, n in batches:
        mine = shard(make_batch(seed, n), world_size)[rank]
        micro.append(len(plan_micro_batches(mine.lengths, cfg.micro_batch_tokens)))
        m = actor.update(mine, num_mini_batches=1, use_rollout_logprobs=False)
        metrics.append({k: m[k] for k in SHARE_KEYS})
    return {"metrics": metrics, "micro_batches": micro, "weights": full_weights(engine)}


def _updates(actor, batches, rank: int, world_size: int) -> list[dict]:
    out = []
    for seed, n in batches:
        m = actor.update(shard(make_batch(seed, n), world_size)[rank], 1, False)
        out.append({k: m[k] for k in SHARE_KEYS})
    return out


def save_then_train(rank: int, world_size: int, model_path: str, ckpt: str, batches=BATCHES,
                    strategy: str = "fsdp2") -> dict:
    """Train on the first batch, checkpoint, train on the rest: the metrics after the checkpoint
    and the final weights (what a resumed run must reproduce)."""
    engine, actor = build(model_path, actor_config(strategy), rank, world_size)
    _updates(actor, batches[:1], rank, world_size)
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    engine.save(Path(ckpt))
    return {"metrics": _updates(actor, batches[1:], rank, world_size), "weights": full_weights(engine)}


def resume_then_train(rank: int, world_size: int, model_path: str, ckpt: str, batches=BATCHES,
                      strategy: str = "fsdp2") -> dict:
    engine, actor = build(model_path, actor_config(strategy), rank, world_size)
    engine.load(Path(ckpt))
    return {"metrics": _updates(actor, batches[1:], rank, world_size), "weights": full_weights(engine)}


def fsdp2_facts(rank: int, world_size: int, model_path: str, ckpt: str) -> dict:
    """Everything the fsdp2 tests check on one world (each world start costs an import of
    transformers per rank): the training run with a checkpoint after the first update, the
    reference engine, and a weight sync."""
    import weakref

    cfg = actor_config("fsdp2")
    engine, actor = build(model_path, cfg, rank, world_size)
    out: dict = {"metrics": [], "micro_batches": []}
    for i, (seed, n) in enumerate(BATCHES):
        mine = shard(make_batch(seed, n), world_size)[rank]
        out["micro_batches"].append(len(plan_micro_batches(mine.lengths, cfg.micro_batch_tokens)))
        m = actor.update(mine, 1, False)
        out["metrics"].append({k: m[k] for k in SHARE_KEYS})
        if i == 0:
            Path(ckpt).mkdir(parents=True, exist_ok=True)
            engine.save(Path(ckpt))
            out["weights_at_save"] = full_weights(engine)
    out["state_bytes"] = engine.state_bytes()
    # weight sync: how many gathered tensors are alive at once when the consumer keeps none
    refs, live_peak, largest, total, seen = [], 0, 0, 0, []
    for name, t in engine.named_weights():
        seen.append((name, t.shape, t.dtype))
        refs.append(weakref.ref(t))
        largest, total = max(largest, t.nbytes), total + t.nbytes
        live_peak = max(live_peak, sum(r() is not None for r in refs))
        del t
    out["sync"] = {"live_peak": live_peak, "largest": largest, "total": total,
                   "specs_match": seen == engine.weight_specs()}
    out["weights"] = full_weights(engine)
    # the reference policy: sharded, frozen, no optimizer state
    ref, _ = build(model_path, cfg, rank, world_size, horizon=None)
    out["reference"] = {
        "optimizer": ref.optimizer, "trainable": sum(p.requires_grad for p in ref.model.parameters()),
        "state_bytes": ref.state_bytes(),
        "logprobs": ref.logprobs(shard(make_batch(5, 5), world_size)[rank]).values}
    return out


def fsdp2_extras(rank: int, world_size: int, model_path: str, ddp_ckpt: str, other_model: str,
                 fsdp2_ckpt: str) -> dict:
    """Gradient checkpointing + actor.offload; resuming a DDP checkpoint; loading a DDP and an
    FSDP2 checkpoint of another model (the error messages)."""
    out = {"checkpointed": train(rank, world_size, model_path, "fsdp2",
                                 overrides={"gradient_checkpointing": True, "offload": True})["metrics"]}
    out["from_ddp"] = resume_then_train(rank, world_size, model_path, ddp_ckpt)
    out["critic"] = critic_updates(rank, world_size, model_path, "fsdp2")
    engine, _ = build(other_model, actor_config("fsdp2"), rank, world_size)
    out["mismatch"] = []
    for ckpt in (ddp_ckpt, fsdp2_ckpt):
        try:
            engine.load(Path(ckpt))
            out["mismatch"].append(None)
        except ValueError as exc:
            out["mismatch"].append(str(exc))
    return out


def critic_updates(rank: int, world_size: int, model_path: str, strategy: str, sp: int = 1) -> list[dict]:
    """The critic (a value head, training/values.py) trained through the engine seam: one
    update per fixed batch, with random values and returns per token (`sp`: the ranks of a
    sequence-parallel group, which train on the same shard)."""
    cfg = actor_config(strategy, ppo_epochs=1, sequence_parallel_size=sp, world_size=world_size)
    # sp groups are neighbouring ranks (mesh.py)
    return train_critic(cfg, model_path, rank, world_size, dp=world_size // sp, data_rank=rank // sp)


def train_critic(cfg: ActorConfig, model_path: str, rank: int, world_size: int, *, dp: int,
                 data_rank: int) -> list[dict]:
    """critic_updates' training under any mesh: `data_rank` of `dp` is this rank's batch shard."""
    from polyrl.training.values import load_value_model, response_values
    from polyrl.workers.critic import CriticUpdate

    torch.manual_seed(0)  # the value head starts from random: the same on every rank and run
    model = load_value_model(model_path, torch.float32)
    platform = get_platform("cpu")
    engine = build_engine(model, cfg, platform, platform.torch_device(0), rank=rank, world_size=world_size,
                          group=dist.group.WORLD if dist.is_initialized() else None, horizon=8,
                          head=response_values)
    critic = CriticUpdate(engine, cfg, AlgorithmConfig(), platform.torch_device(0))
    out = []
    for seed, n in BATCHES:
        batch = make_batch(seed, n)
        g = torch.Generator().manual_seed(seed + 100)
        T = len(batch.response_ids.values)
        batch = batch.replace(values=batch.response_ids.with_values(torch.randn(T, generator=g)),
                              returns=batch.response_ids.with_values(torch.randn(T, generator=g)))
        m = critic.update(shard(batch, dp)[data_rank], 1)
        out.append({k: m[k] for k in ("critic/value_loss", "critic/grad_norm")})
    return out


def sequence_parallel_facts(rank: int, world_size: int, model_path: str, strategy: str, sp: int,
                            critic: bool = True, overrides: dict | None = None) -> dict:
    """Training under actor.sequence_parallel_size=`sp`: each rank's batch shard is its data rank's
    (polyrl/training/mesh.py), the same on the ranks of one sp group. The reference log-probs of
    a batch, the policy's updates, the tokens each rank fed per micro-batch, and the critic's."""
    from polyrl.training.mesh import ParallelDims

    dims = ParallelDims.of(strategy, world_size, sp)

    def mine(batch: RolloutBatch) -> RolloutBatch:
        return shard(batch, dims.data_parallel_size)[dims.data_rank(rank)]

    cfg = actor_config(strategy, sequence_parallel_size=sp, world_size=world_size, **(overrides or {}))
    ref, _ = build(model_path, cfg, rank, world_size, horizon=None)
    out: dict = {"reference": ref.logprobs(mine(make_batch(5, 5))).values}
    engine, actor = build(model_path, cfg, rank, world_size)
    out["fed"] = [(int(mb.input_ids.shape[1]), int(mb.sequence_shard.start))
                  for mb in engine.micro_batches(mine(make_batch(*BATCHES[0])))]
    out["metrics"] = []
    for seed, n in BATCHES:
        m = actor.update(mine(make_batch(seed, n)), num_mini_batches=1, use_rollout_logprobs=False)
        out["metrics"].append({k: m[k] for k in SHARE_KEYS})
    out["weights"] = full_weights(engine)
    if critic:
        out["critic"] = critic_updates(rank, world_size, model_path, strategy, sp=sp)
    return out


def one_rank_facts(model_path: str) -> dict:
    """What `sequence_parallel_facts` computes, on one rank with the packed layout it uses."""
    cfg = actor_config("ddp", packing="on")
    ref, _ = build(model_path, cfg, 0, 1, horizon=None)
    out: dict = {"reference": ref.logprobs(make_batch(5, 5)).values}
    out.update(train(0, 1, model_path, "ddp", overrides={"packing": "on"}))
    out["critic"] = critic_updates(0, 1, model_path, "ddp")
    return out


def ulysses_attention_facts(rank: int, world_size: int) -> dict:
    """The Ulysses exchange alone (training/ulysses.py) around a plain causal SDPA: this rank's
    slice of the output and of the input gradients, for a fixed random row."""
    import torch.nn.functional as F

    from polyrl.training.ulysses import SequenceParallel, SequenceShard, ulysses_attention

    g = torch.Generator().manual_seed(0)
    T, D = 12, 8
    q = torch.randn(1, 4, T, D, generator=g)
    k, v = (torch.randn(1, 2, T, D, generator=g) for _ in range(2))
    weight = torch.randn(1, T, 4, D, generator=g)
    t = T // world_size
    cut = slice(rank * t, (rank + 1) * t)
    mine = [x[:, :, cut].clone().requires_grad_() for x in (q, k, v)]

    def causal(module, q, k, v, mask, **kwargs):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2), None

    shard = SequenceShard(SequenceParallel(dist.group.WORLD, world_size, rank), cut.start, cut.stop)
    out, _ = ulysses_attention(causal, None, *mine, None, shard)
    (out * weight[:, cut]).sum().backward()
    return {"out": out.detach(), "grads": [x.grad for x in mine]}


def sequence_parallel_misfed(rank: int, world_size: int, model_path: str) -> str:
    """Two sp ranks given different shards (a driver sharding over every rank): the error."""
    cfg = actor_config("fsdp2", sequence_parallel_size=2, world_size=world_size)
    engine, _ = build(model_path, cfg, rank, world_size, horizon=None)
    try:
        engine.logprobs(shard(make_batch(5, 5), world_size)[rank])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def mesh_beside_other_ranks(rank: int, world_size: int) -> dict | None:
    """A sync standalone world: ranks 0, 1 train, rank 2 is a rollout replica; every rank makes
    the layout's groups (polyrl/distributed/layout.py build_groups), then the trainer ranks
    build their mesh's groups (sp=2 over both: the group of every trainer rank)."""
    from polyrl.training.mesh import ParallelDims
    from polyrl.training.mesh_groups import mesh_groups

    from polyrl.distributed.layout import RankLayout, build_groups

    layout = RankLayout(num_replicas=1, tensor_parallel_size=1, trainer_world_size=2)
    trainer = build_groups(layout, rank, backend="gloo").groups.get("trainer")
    if rank >= 2:
        return None
    groups = mesh_groups(ParallelDims(sp=2), trainer)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups.sequence.group)
    return {"sum": float(t), "sp_index": groups.sequence.index}
