"""LoRA on actor.strategy=fsdp2, on real gloo ranks: 2 fsdp2 ranks train the adapters as 1 DDP rank
does (same step metrics, same merged weights), only adapters hold optimizer state, the reference is
the sharded base model with the adapters off, checkpoints hold the sharded state + the merged
policy + the peft adapter, and resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok

pytestmark = pytest.mark.slow  # two gloo ranks that each build a peft model, and a resume

RTOL = 1e-5


def build(model_path: str, strategy: str, rank: int, world_size: int):
    import torch.distributed as dist

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.lora import LoraConfig, apply_lora
    from polyrl.workers.actor import PPOActor
    from polyrl.training.model_loading import load_causal_lm

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    cfg = engine_ranks.actor_config(strategy)
    torch.manual_seed(0)  # LoRA's A starts random: the same on every rank and in every run
    model = apply_lora(load_causal_lm(model_path), LoraConfig(lora_rank=4))
    engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                          group=dist.group.WORLD if dist.is_initialized() else None, horizon=8)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def lora_run(rank: int, world_size: int, model_path: str, strategy: str, ckpt: str) -> dict:
    from polyrl.batch import shard
    from polyrl.training.lora import adapters_disabled

    engine, actor = build(model_path, strategy, rank, world_size)
    out: dict = {"metrics": []}
    for i, (seed, n) in enumerate(engine_ranks.BATCHES):
        m = actor.update(shard(engine_ranks.make_batch(seed, n), world_size)[rank], 1, False)
        out["metrics"].append({k: m[k] for k in engine_ranks.SHARE_KEYS})
        if i == 0:
            Path(ckpt).mkdir(parents=True, exist_ok=True)
            engine.save(Path(ckpt))
    out["optimizer_params"] = sorted(n for n, p in engine.model.named_parameters()
                                     if any(p is q for g in engine.optimizer.param_groups for q in g["params"]))
    out["weights"] = engine_ranks.full_weights(engine)  # merged, Hugging Face names
    out["adapter"] = {k: v.clone() for k, v in engine.adapter_stream()}  # rollout.lora_mode=adapter
    from polyrl.rollout.native.engine import NativeEngine  # hybrid: merged weights synced in place
    from polyrl.distributed.topologies import COLOCATED
    from polyrl.weights import WeightSyncConfig, build_transport

    native = NativeEngine(model_path, max_model_len=32)
    build_transport(WeightSyncConfig(), COLOCATED, engine=native).send(engine.weight_stream(), 1)
    out["native"] = {n: v.clone() for n, (v, _) in native._weights.targets.items()}
    with adapters_disabled(engine.model):
        out["reference"] = engine.logprobs(shard(engine_ranks.make_batch(5, 5), world_size)[rank]).values
    resumed, resumed_actor = build(model_path, strategy, rank, world_size)
    resumed.load(Path(ckpt))
    out["resumed"] = engine_ranks._updates(resumed_actor, engine_ranks.BATCHES[1:], rank, world_size)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2-lora")
    ddp = lora_run(0, 1, tiny_model, "ddp", str(tmp / "ddp-ckpt"))
    (tmp / "world").mkdir()
    fsdp2 = run_world_ok(lora_run, 2, tmp / "world", args=(tiny_model, "fsdp2", str(tmp / "fsdp2-ckpt")),
                         timeout_s=400, backend_timeout_s=300)
    return ddp, fsdp2, tmp


def test_two_fsdp2_ranks_train_lora_as_one_ddp_rank(runs, tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    ddp, fsdp2, _ = runs
    for r in fsdp2.values():
        for a, b in zip(r["metrics"], ddp["metrics"]):
            for k in engine_ranks.SHARE_KEYS:
                assert a[k] == pytest.approx(b[k], rel=RTOL, abs=1e-9), (k, a, b)
        assert r["optimizer_params"] == ddp["optimizer_params"]  # the adapters, nothing else
        assert r["optimizer_params"] and all(".lora_" in n for n in r["optimizer_params"])
    merged = fsdp2[0]["weights"]
    assert sorted(merged) == sorted(ddp["weights"]) and not any("lora" in k for k in merged)
    for k, v in ddp["weights"].items():
        torch.testing.assert_close(merged[k], v, rtol=RTOL, atol=1e-5, msg=k)
    assert all(torch.equal(merged[k], fsdp2[1]["weights"][k]) for k in merged)
    for r in (*fsdp2.values(), ddp):  # the colocated engine got the merged weights in place
        assert all(torch.equal(r["native"][k], r["weights"][k]) for k in r["native"] if k in r["weights"])
    assert sorted(fsdp2[0]["adapter"]) == sorted(ddp["adapter"]) and ddp["adapter"]
    for k, v in ddp["adapter"].items():  # the adapter alone, gathered whole from the shards
        torch.testing.assert_close(fsdp2[0]["adapter"][k], v, rtol=RTOL, atol=1e-6, msg=k)
    base = dict(load_causal_lm(tiny_model).named_parameters())
    assert max((merged[k] - base[k]).abs().max().item() for k in merged) > 1e-4  # the adapters moved


def test_the_reference_is_the_base_model(runs, tiny_model):
    from polyrl.batch import shard

    _, fsdp2, _ = runs
    base, _ = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1, horizon=None)
    for rank, r in fsdp2.items():
        expected = base.logprobs(shard(engine_ranks.make_batch(5, 5), 2)[rank]).values
        torch.testing.assert_close(r["reference"], expected, rtol=1e-5, atol=1e-6)


def test_checkpoint_holds_adapter_and_merged_policy_and_resumes_exactly(runs):
    from safetensors.torch import load_file

    ddp, fsdp2, tmp = runs
    ckpt = tmp / "fsdp2-ckpt"
    for name in ("dcp/.metadata", "engine.pt", "policy/model.safetensors", "policy/config.json",
                 "policy_adapter/adapter_config.json", "policy_adapter/adapter_model.safetensors"):
        assert (ckpt / name).is_file(), name
    ours, theirs = (load_file(str(d / "policy_adapter" / "adapter_model.safetensors"))
                    for d in (ckpt, tmp / "ddp-ckpt"))
    assert sorted(ours) == sorted(theirs)  # peft's names, gathered whole from the shards
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=RTOL, atol=1e-6, msg=k)
    for r in fsdp2.values():
        assert r["resumed"] == r["metrics"][1:]  # bit for bit: the sharded state round-trips
