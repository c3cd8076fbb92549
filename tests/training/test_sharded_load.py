"""actor.strategy=fsdp2 loads on the meta device and reads each rank's shards only
(polyrl/training/sharded_load.py): on real gloo ranks, the same log-probs and the same weights
after a training step as loading the whole model first, tied embeddings or not; and a rank's
resident-memory peak while loading stays well below the model's size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok

MiB = 2**20


def _write_model(path: Path, tied: bool, hidden: int = 64, layers: int = 2, vocab: int = 128) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(1)
    # hidden and vocab chosen so that no dim 0 divides evenly by 2 ranks in the untied model: the
    # padded, uneven shards are where a wrong row range would show
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden + (0 if tied else 3),
                         vocab_size=vocab + (0 if tied else 1), max_position_embeddings=128,
                         eos_token_id=1, pad_token_id=0, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their init of ones: a norm read wrongly would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return str(path)


def _engine(model_path: str, deferred: bool, rank: int, world_size: int, horizon: int | None = 8):
    import torch.distributed as dist

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.workers.actor import PPOActor

    cfg = engine_ranks.actor_config("fsdp2")
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    model = load_causal_lm(model_path, cfg.param_dtype, deferred=deferred)
    if not deferred:
        model = model.to(device)
    assert any(p.is_meta for p in model.parameters()) == deferred  # the path under test is taken
    engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                          group=dist.group.WORLD, horizon=horizon)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def load_then_train(rank: int, world_size: int, model_paths: list[str]) -> list[dict]:
    """For each model, both loadings on this rank: log-probs of a batch, then the full weights
    after one update (one world for all: a world's start costs more than the work)."""
    from polyrl.batch import shard

    results = []
    for model_path in model_paths:
        out = {}
        for deferred in (True, False):
            engine, actor = _engine(model_path, deferred, rank, world_size)
            batch = engine_ranks.make_batch(5, 7)
            logprobs = engine.logprobs(batch).values.clone()
            actor.update(shard(batch, world_size)[rank], num_mini_batches=1, use_rollout_logprobs=False)
            module = engine.module
            out[deferred] = {"logprobs": logprobs, "weights": engine_ranks.full_weights(engine),
                             "tied": module.lm_head.weight is module.model.embed_tokens.weight,
                             "buffers": {k: v.clone() for k, v in module.named_buffers()}}
        results.append(out)
    return results


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def load_peak(rank: int, world_size: int, model_path: str, deferred: bool) -> dict:
    """The resident high-water mark's rise while loading a frozen engine (as the benchmark's
    `load` phase, benchmarks/_memory_rank.py), and the bytes of this rank's shards."""
    import gc

    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (an import is not the load)

    from polyrl.training.checkpoint_io import local_state_bytes

    gc.collect()
    start = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    engine, _ = _engine(model_path, deferred, rank, world_size, horizon=None)
    rise = (_status_kib("VmHWM") - start) * 1024
    return {"rise": rise, "shards": local_state_bytes(engine.model, None)["params"]}


@pytest.fixture(scope="module")
def both_loadings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded-load")
    paths = [_write_model(tmp / f"tied-{tied}", tied) for tied in (True, False)]
    (tmp / "world").mkdir()
    ranks = run_world_ok(load_then_train, 2, tmp / "world", args=(paths,), timeout_s=240, backend_timeout_s=200)
    return {tied: {rank: r[i] for rank, r in ranks.items()} for i, tied in enumerate((True, False))}


@pytest.mark.slow  # one 2-rank world: ~50 s here
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_load_matches_loading_the_whole_model(both_loadings, tied):
    for rank, r in both_loadings[tied].items():
        new, old = r[True], r[False]
        assert new["tied"] == old["tied"] == tied
        torch.testing.assert_close(new["logprobs"], old["logprobs"], rtol=0, atol=1e-6)
        assert sorted(new["weights"]) == sorted(old["weights"])
        for k in old["weights"]:
            torch.testing.assert_close(new["weights"][k], old["weights"][k], rtol=0, atol=1e-6, msg=k)
        assert sorted(new["buffers"]) == sorted(old["buffers"]) and new["buffers"]  # rotary inv_freq
        for k in old["buffers"]:
            assert torch.equal(new["buffers"][k], old["buffers"][k]), k


def test_a_checkpoint_it_cannot_read_exactly_is_loaded_whole(tmp_path):
    from safetensors.torch import load_file, save_file

    from polyrl.training.model_loading import load_causal_lm

    path = Path(_write_model(tmp_path / "m", tied=False))
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight_renamed"] = tensors.pop("lm_head.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(str(path), deferred=True)  # from_pretrained's own handling, as before
    assert not any(p.is_meta for p in model.parameters())


def test_ddp_materializes_a_deferred_model_whole(tmp_path):
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.training.model_loading import load_causal_lm

    path = _write_model(tmp_path / "m", tied=True)
    cfg = engine_ranks.actor_config("ddp")
    engine = build_engine(load_causal_lm(path, deferred=True), cfg, get_platform("cpu"), torch.device("cpu"))
    whole = load_causal_lm(path)
    got = dict(engine.named_weights())
    assert all(torch.equal(got[k], v) for k, v in whole.named_parameters())
    assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    buffers = dict(engine.module.named_buffers())
    assert buffers and all(torch.equal(buffers[k], v) for k, v in whole.named_buffers())  # rotary inv_freq


@pytest.mark.slow
def test_a_rank_never_holds_the_whole_model_while_loading(tmp_path, deferred=True):
    # ~30M parameters (120 MiB in fp32): large against the runtime's own allocations
    path = _write_model(tmp_path / "m", tied=True, hidden=512, layers=8, vocab=16000)
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        full = sum(f.get_tensor(k).nbytes for k in f.keys())
    (tmp_path / "world").mkdir()
    ranks = run_world_ok(load_peak, 2, tmp_path / "world", args=(path, deferred), timeout_s=240, backend_timeout_s=200)
    for r in ranks.values():
        assert 0.45 * full <= r["shards"] <= 0.55 * full
        # loading the whole model first peaks at ~1.5x the model here (docs/benchmarks.md)
        assert r["rise"] < 0.8 * full, (r["rise"] / MiB, full / MiB)



def lora_and_critic(rank: int, world_size: int, model_path: str) -> dict:
    """On this rank, loaded deferred (each rank reading its shards) and whole (then broadcast from
    rank 0, as PolicyWorker does): a LoRA policy's log-probs and its merged weights and adapters
    after one update; a critic's values and its weights after one update. The random starts
    (adapters, value head) are drawn from each rank's own seed, as in a run."""
    import torch.distributed as dist

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.batch import shard
    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.training.lora import apply_lora
    from polyrl.training.lora_config import LoraConfig
    from polyrl.training.model_loading import load_causal_lm
    from polyrl.training.values import load_value_model, response_values
    from polyrl.workers.actor import PPOActor
    from polyrl.workers.critic import CriticUpdate

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    cfg = engine_ranks.actor_config("fsdp2", ppo_epochs=1)
    batch = engine_ranks.make_batch(5, 7)
    g = torch.Generator().manual_seed(9)
    T = len(batch.response_ids.values)
    batch = batch.replace(values=batch.response_ids.with_values(torch.randn(T, generator=g)),
                          returns=batch.response_ids.with_values(torch.randn(T, generator=g)))
    mine = shard(batch, world_size)[rank]

    def same_start(model):  # the whole load's identical start on every rank
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    out: dict = {}
    for deferred in (True, False):
        torch.manual_seed(100 + rank)
        model = load_causal_lm(model_path, deferred=deferred)
        model = apply_lora(model, LoraConfig(lora_rank=4, lora_target_modules="all-linear"))
        assert sharded_load.is_deferred(model) == deferred
        if not deferred:
            same_start(model)
        engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                              group=dist.group.WORLD, horizon=8)
        actor = PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
        lora = {"logprobs": engine.logprobs(batch).values.clone()}
        actor.update(mine, num_mini_batches=1, use_rollout_logprobs=False)
        lora["merged"] = engine_ranks.full_weights(engine)
        lora["adapters"] = {k: v.clone() for k, v in engine.adapter_tensors()}

        torch.manual_seed(200 + rank)
        value_model = (sharded_load.deferred_value_model(Path(model_path), torch.float32) if deferred
                       else load_value_model(model_path, torch.float32))
        assert sharded_load.is_deferred(value_model) == deferred
        if not deferred:
            same_start(value_model)
        critic_engine = build_engine(value_model, cfg, platform, device, rank=rank, world_size=world_size,
                                     group=dist.group.WORLD, horizon=8, head=response_values)
        critic = {"values": critic_engine.logprobs(batch).values.clone()}
        CriticUpdate(critic_engine, cfg, AlgorithmConfig(), device).update(mine, 1)
        critic["weights"] = engine_ranks.full_weights(critic_engine)
        out[deferred] = {"lora": lora, "critic": critic}
    return out


@pytest.mark.slow  # one 2-rank world
def test_lora_and_critic_load_sharded_as_they_load_whole(tmp_path):
    path = _write_model(tmp_path / "m", tied=False)
    (tmp_path / "world").mkdir()
    ranks = run_world_ok(lora_and_critic, 2, tmp_path / "world", args=(path,), timeout_s=300, backend_timeout_s=240)
    for rank, r in ranks.items():
        new, old = r[True], r[False]
        torch.testing.assert_close(new["lora"]["logprobs"], old["lora"]["logprobs"], rtol=0, atol=1e-6)
        torch.testing.assert_close(new["critic"]["values"], old["critic"]["values"], rtol=0, atol=1e-6)
        for group in (("lora", "merged"), ("lora", "adapters"), ("critic", "weights")):
            a, b = new[group[0]][group[1]], old[group[0]][group[1]]
            assert sorted(a) == sorted(b) and a, group
            for k in b:
                torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=f"{group} {k}")
        assert any(v.abs().max() > 0 for k, v in new["lora"]["adapters"].items() if "lora_B" in k)  # it trained
