"""LoRA under tensor parallelism (model.lora_rank > 0, actor.tensor_parallel_size=2) on real gloo
ranks, fp32: two tp ranks train the adapters as one rank does (log-probs, losses, gradient
norms, the adapters after the steps), the optimizer holds the adapters alone, the reference is
the sliced base with the adapters off, the weight sync streams merged weights one tensor at a
time into a real engine, and the checkpoint (sharded state, merged policy, peft adapter) resumes
exactly and exports as one rank's does. The policy loads as PolicyWorker loads it under fsdp2:
on the meta device, each rank reading its own blocks, the adapters' first values rank 0's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from tp_ranks import ADAM_EPS, gathered_weights

pytestmark = pytest.mark.slow  # two gloo ranks that each build a peft model twice, and a resume

TOL = 1e-5
LORA_RANK = 4


def build(model_path: str, cfg, rank: int, world_size: int):
    import torch.distributed as dist

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.training.lora import LoraConfig, apply_lora
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.workers.actor import PPOActor

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    # LoRA's A starts random: a different draw on each rank, so only the load's broadcast of rank
    # 0's values (over both mesh dims) makes them equal to the one-rank run's
    torch.manual_seed(rank)
    deferred = cfg.strategy == "fsdp2"
    model = apply_lora(load_causal_lm(model_path, cfg.param_dtype, deferred=deferred), LoraConfig(lora_rank=LORA_RANK))
    assert sharded_load.is_deferred(model) == deferred
    engine = build_engine(model if deferred else model.to(device), cfg, platform, device, rank=rank,
                          world_size=world_size, group=dist.group.WORLD if dist.is_initialized() else None, horizon=8)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def lora_run(rank: int, world_size: int, model_path: str, tp: int, ckpt: str) -> dict:
    from polyrl.batch import shard
    from polyrl.distributed.topologies import COLOCATED
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.lora import adapters_disabled
    from polyrl.training.mesh import ParallelDims
    from polyrl.weights import WeightSyncConfig, build_transport

    strategy = "fsdp2" if world_size > 1 else "ddp"
    cfg = engine_ranks.actor_config(strategy, world_size=world_size, tensor_parallel_size=tp, eps=ADAM_EPS)
    dims = ParallelDims.from_actor(cfg)
    engine, actor = build(model_path, cfg, rank, world_size)

    def updates(actor, batches) -> list[dict]:
        out = []
        for seed, n in batches:
            mine = shard(engine_ranks.make_batch(seed, n), dims.data_parallel_size)[dims.data_rank(rank)]
            m = actor.update(mine, num_mini_batches=1, use_rollout_logprobs=False)
            out.append({k: m[k] for k in engine_ranks.SHARE_KEYS})
        return out

    out: dict = {"dims": dims.describe()}
    batches = engine_ranks.BATCHES
    out["metrics"] = updates(actor, batches[:1])
    Path(ckpt).mkdir(parents=True, exist_ok=True)
    engine.save(Path(ckpt))
    out["metrics"] += updates(actor, batches[1:])
    out["optimizer_params"] = sorted(n for n, p in engine.model.named_parameters()
                                     if any(p is q for g in engine.optimizer.param_groups for q in g["params"]))
    probe = engine_ranks.make_batch(5, 5)  # the whole batch on every rank: comparable to one rank
    out["logprobs"] = engine.logprobs(probe).values
    with adapters_disabled(engine.model):
        out["reference"] = engine.logprobs(probe).values
    out["adapter"] = {k: v.clone() for k, v in engine.adapter_stream()}  # rollout.lora_mode=adapter
    out["weights"], out["live_peak"] = gathered_weights(engine)  # merged, one tensor at a time
    native = NativeEngine(model_path, max_model_len=32)  # the built-in engine, synced in place
    build_transport(WeightSyncConfig(), COLOCATED, engine=native).send(engine.weight_stream(), 1)
    out["native"] = {n: v.clone() for n, (v, _) in native._weights.targets.items()}
    resumed, resumed_actor = build(model_path, cfg, rank, world_size)
    resumed.load(Path(ckpt))
    out["resumed"] = updates(resumed_actor, batches[1:])
    return out


def one_and_tp2(model_path: str, tmp_path: Path) -> tuple[dict, dict[int, dict]]:
    """`lora_run` on one rank and on two tp ranks; asserts the two train, sync and resume alike."""
    one = lora_run(0, 1, model_path, 1, str(tmp_path / "one-ckpt"))
    (tmp_path / "world").mkdir()
    ranks = run_world_ok(lora_run, 2, tmp_path / "world", args=(model_path, 2, str(tmp_path / "tp-ckpt")),
                         timeout_s=500, backend_timeout_s=400)
    for r in ranks.values():
        assert r["dims"] == "2 ranks: tp=2"
        torch.testing.assert_close(r["logprobs"], one["logprobs"], rtol=TOL, atol=TOL)
        torch.testing.assert_close(r["reference"], one["reference"], rtol=TOL, atol=TOL)
        for a, b in zip(r["metrics"], one["metrics"], strict=True):
            for k in ("actor/loss", "actor/grad_norm", "actor/lr"):
                assert a[k] == pytest.approx(b[k], rel=TOL, abs=1e-9), (k, a, b)
        assert r["optimizer_params"] == one["optimizer_params"]  # the adapters, nothing else
        assert r["optimizer_params"] and all(".lora_" in n for n in r["optimizer_params"])
        assert sorted(r["adapter"]) == sorted(one["adapter"]) and one["adapter"]
        for k, v in one["adapter"].items():  # A and B after the steps, gathered whole from the slices
            torch.testing.assert_close(r["adapter"][k], v, rtol=TOL, atol=TOL, msg=k)
        assert sorted(r["weights"]) == sorted(one["weights"]) and not any("lora" in k for k in r["weights"])
        for k, v in one["weights"].items():
            torch.testing.assert_close(r["weights"][k], v, rtol=TOL, atol=TOL, msg=k)
        assert r["live_peak"] == 1
        # the engine got the merged weights (and ties its head to the embedding itself; it holds a
        # Qwen3 per-head q/k norm once per head)
        assert set(r["weights"]) <= set(r["native"])
        assert all(torch.equal(r["native"][k], r["weights"][k].expand_as(r["native"][k])) for k in r["weights"])
        assert r["resumed"] == r["metrics"][1:]  # bit for bit: the sliced, sharded state round-trips
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    return one, ranks


def test_lora_at_tp2_trains_syncs_checkpoints_and_exports_as_one_rank(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from polyrl.cli.export import export
    from polyrl.training.model_loading import load_causal_lm

    one, ranks = one_and_tp2(tiny_model, tmp_path)
    base = dict(load_causal_lm(tiny_model).named_parameters())
    assert max((one["weights"][k] - base[k]).abs().max().item() for k in one["weights"]) > 1e-4  # adapters moved
    # the checkpoint exports as one rank's: the merged model, and with --adapter-only the adapter
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for run in ("tp", "one"):  # what the trainer's checkpoint adds beside the engine's files
        tokenizer.save_pretrained(str(tmp_path / f"{run}-ckpt" / "policy"))
    for adapter_only, file in ((False, "model.safetensors"), (True, "adapter_model.safetensors")):
        ours, theirs = (load_file(str(export(tmp_path / f"{run}-ckpt", tmp_path / f"{run}-export-{adapter_only}",
                                             adapter_only=adapter_only) / file)) for run in ("tp", "one"))
        assert sorted(ours) == sorted(theirs) and ours
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=TOL, atol=TOL, msg=k)


def test_moe_lora_on_the_experts_at_tp2_trains_and_resumes_as_one_rank(tmp_path):
    """All-linear LoRA on a Qwen3-MoE adapts its fused experts (in no tp plan: whole and
    replicated on both tp ranks, sharded over the data ranks alone). Their adapters must start
    as rank 0 drew them on both tp ranks (each rank draws from its own seed here): the deferred
    load broadcasts initial values over every trainer rank, not the tensor's own mesh; without
    that the tp replicas diverge (2.3e-3 in log-probs after three updates) and resume inexactly."""
    from test_tensor_parallel import qwen3_moe_untied
    from tiny_models import char_tokenizer

    from polyrl.training.model_loading import load_causal_lm

    path = qwen3_moe_untied(tmp_path / "moe")
    char_tokenizer().save_pretrained(path)
    one, ranks = one_and_tp2(path, tmp_path)
    experts = sorted(k for k in one["adapter"] if ".experts." in k)
    assert experts, sorted(one["adapter"])  # the experts' adapters are among those compared
    base = dict(load_causal_lm(path).named_parameters())
    moved = [k for k in one["weights"] if ".experts." in k and (one["weights"][k] - base[k]).abs().max() > 1e-4]
    assert moved, "the experts' adapters did not change the merged experts"
