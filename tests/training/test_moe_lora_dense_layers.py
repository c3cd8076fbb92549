"""LoRA on a mixture-of-experts model's dense MLPs (docs/moe.md, "LoRA"): a layer of
`mlp_only_layers` between expert layers and Qwen2-MoE's shared expert get adapters on their
gate/up/down_proj beside the experts' fused tensors (peft alone would turn those names into the
experts' and leave the dense MLPs without); after an update they have trained, the merged
weights reproduce the trainer in the native engine within 1e-5 (fp32), and the exported merged
model, the exported adapter (loaded by peft) and a resumed adapter give the same log-probs."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from moe_models import build_moe_model
from polyrl.rollout.native.engine import NativeEngine
from polyrl.training.lora import LoraError, adapted_targets, apply_lora, export, load_adapter, save_adapter
from polyrl.training.lora_config import LoraConfig
from polyrl.training.model_loading import load_causal_lm
from test_moe_training import sampled_batch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    """3 layers: 0 and 2 expert layers, 1 a dense MLP (mlp_only_layers=[1])."""
    return build_moe_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def expected(layers: int, dense: tuple[int, ...], shared: bool, attention=ATTENTION) -> set[str]:
    out = {f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in attention}
    for i in range(layers):
        if i in dense:
            out |= {f"model.layers.{i}.mlp.{p}" for p in MLP}
        else:
            out |= {f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"}
            out |= {f"model.layers.{i}.mlp.shared_expert.{p}" for p in MLP} if shared else set()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_every_dense_mlp_and_every_expert_tensor_gets_an_adapter(arch, qwen3_moe, tmp_path):
    path = qwen3_moe if arch == "qwen3_moe" else build_moe_model(tmp_path, arch)
    shared = arch == "qwen2_moe"
    model = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4))
    # the routers and Qwen2-MoE's one-output shared_expert_gate are gates: no adapter
    assert adapted_targets(model) == expected(3, dense=(1,), shared=shared)
    # the experts' gate_up_proj holds gate and up: rank 2 x 4, the same scaling alpha / rank = 2
    ranks = {(getattr(m, "parameter_name", "weight"), m.r["default"], m.scaling["default"])
             for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert ranks == {("gate_up_proj", 8, 2.0), ("down_proj", 4, 2.0), ("weight", 4, 2.0)}
    listed = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4, lora_target_modules=["q_proj", *MLP]))
    assert adapted_targets(listed) == expected(3, dense=(1,), shared=shared, attention=("q_proj",))
    with pytest.raises(LoraError, match=r"model.lora_target_modules: .*gate_up_proj.*'gate_proj' needs "
                                        r"'up_proj' beside it; name both or neither"):
        apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4, lora_target_modules=["q_proj", "gate_proj",
                                                                                       "down_proj"]))


def test_an_moe_without_dense_layers_adapts_its_experts(tmp_path):
    """Every layer an expert layer (Qwen3-30B-A3B's layout, builtin:tiny-moe's): the experts are
    adapted under all-linear and by their per-expert names, not only beside a dense layer."""
    path = build_moe_model(tmp_path, "qwen3_moe", layers=2)
    assert adapted_targets(apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4))) == expected(2, (), False)
    down = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4, lora_target_modules=["down_proj"]))
    assert adapted_targets(down) == {"model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(LoraError, match=r"model.lora_dropout=0.1: .*set model.lora_dropout=0"):
        apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4, lora_dropout=0.1))


def logprobs_of(model: torch.nn.Module, batch) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for i in range(len(batch)):
            ids = torch.cat([batch.prompt_ids.row(i), batch.response_ids.row(i)])[None]
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(batch.prompt_ids.row(i))
            rows.append(logp[p - 1:-1].gather(1, batch.response_ids.row(i)[:, None]).squeeze(1))
    return torch.cat(rows)


def test_qwen2_moe_shared_expert_adapters_merge_into_the_engine(tmp_path):
    """Qwen2-MoE: the shared expert's and the dense layer's adapters (random B) fold into the
    merged weights, which the native engine serves with the adapted policy's log-probs (1e-5)."""
    from polyrl.training.lora import merged_named_weights

    path = build_moe_model(tmp_path, "qwen2_moe")
    model = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    merged = dict(merged_named_weights(model))
    base = dict(load_causal_lm(path).named_parameters())
    for name in ("model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(merged[name], base[name]), name
    engine = NativeEngine(path, max_model_len=64, tokenizer=False)
    engine.update_weights(merged, version=1)
    batch = sampled_batch(engine, n=1)
    assert (logprobs_of(model.get_base_model().eval(), batch) - batch.rollout_logprobs.values).abs().max() <= 1e-5


def test_dense_adapters_train_sync_export_and_resume(qwen3_moe, tmp_path):
    """One LoRA update (ddp, fp32, nonzero lr): the dense layer's adapters trained (B != 0), the
    merged weights synced to the native engine reproduce the trainer's log-probs within 1e-5; the
    merged export loads in transformers and the adapter export in peft with the same log-probs,
    and the adapter resumes exactly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.workers.actor import PPOActor

    cfg = LoraConfig(lora_rank=4)
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(qwen3_moe), cfg)
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    actor_cfg = engine_ranks.actor_config("ddp", ppo_epochs=1)
    trainer = build_engine(model, actor_cfg, platform, device, rank=0, world_size=1, group=None, horizon=4)
    actor = PPOActor(trainer, actor_cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
    actor.update(engine_ranks.make_batch(seed=3, n=6), 1, False)

    params = dict(model.named_parameters())
    for p in MLP:
        b = params[f"base_model.model.model.layers.1.mlp.{p}.lora_B.default.weight"]
        assert b.abs().max().item() > 0, f"the dense layer's {p} adapter did not train"
    assert params["base_model.model.model.layers.0.mlp.experts.lora_B.default.weight"].abs().max().item() > 0

    merged = engine_ranks.full_weights(trainer)
    base = dict(load_causal_lm(qwen3_moe).named_parameters())
    assert set(merged) == set(base)
    for p in MLP:
        name = f"model.layers.1.mlp.{p}.weight"
        assert not torch.equal(merged[name], base[name]), f"{name}: no adapter folded in"
    engine = NativeEngine(qwen3_moe, max_model_len=64, tokenizer=False)
    engine.update_weights(merged, version=1)
    batch = sampled_batch(engine, n=1)
    ours = trainer.logprobs(batch).values.float()
    assert (ours - batch.rollout_logprobs.values).abs().max().item() <= 1e-5

    export(model, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert (logprobs_of(plain, batch) - ours).abs().max().item() <= 1e-5
    export(model, tmp_path / "adapter", adapter_only=True)
    base_model = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    assert adapted_targets(loaded) == adapted_targets(model)  # peft's own load keeps the dense adapters
    assert (logprobs_of(loaded, batch) - ours).abs().max().item() <= 1e-5

    save_adapter(model, tmp_path / "ckpt")
    fresh = apply_lora(load_causal_lm(qwen3_moe), cfg)
    load_adapter(fresh, tmp_path / "ckpt")
    want = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    # an adapter written before the dense MLPs had adapters (the experts by short name) does not
    # resume: its tensors and optimizer state miss the dense layers'
    config = tmp_path / "ckpt" / "adapter_config.json"
    config.write_text(config.read_text().replace('"target_parameters": [', '"target_parameters": ["down_proj", '
                                                                            '"gate_up_proj"], "was": ['))
    with pytest.raises(LoraError, match=r"holds adapters on the parameters \['down_proj', 'gate_up_proj'\].*"
                                        r"start a run from its merged policy/"):
        load_adapter(apply_lora(load_causal_lm(qwen3_moe), cfg), tmp_path / "ckpt")


def test_deferred_load_draws_the_moe_adapters_peft_draws(qwen3_moe):
    """A deferred (sharded) load's adapters are drawn again from peft's RNG state (`_adapter_init`):
    for the experts' [r x E, in] factors and the dense MLPs' they equal what peft draws on a
    loaded model."""
    from polyrl.training.lora import _adapter_init

    model = load_causal_lm(qwen3_moe)
    rng = torch.get_rng_state()
    wrapped = apply_lora(model, LoraConfig(lora_rank=4))
    drawn = _adapter_init(wrapped.get_base_model(), rng)
    params = dict(wrapped.get_base_model().named_parameters())
    assert set(drawn) == {n for n in params if ".lora_" in n}
    assert all(torch.equal(drawn[n], params[n]) for n in drawn)


def deferred_and_whole(rank: int, world_size: int, model_path: str) -> dict:
    """This rank's LoRA policy (fsdp2) loaded deferred (each rank reading its shards, the adapters
    drawn by `_adapter_init`) and whole (rank 0's values broadcast): log-probs, merged weights and
    adapters after one update."""
    import torch.distributed as dist

    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.batch import shard
    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.workers.actor import PPOActor

    platform = get_platform("cpu")
    device = platform.torch_device(0)
    cfg = engine_ranks.actor_config("fsdp2", ppo_epochs=1)
    batch = engine_ranks.make_batch(5, 7)
    out = {}
    for deferred in (True, False):
        torch.manual_seed(100 + rank)
        model = apply_lora(load_causal_lm(model_path, deferred=deferred), LoraConfig(lora_rank=4))
        assert sharded_load.is_deferred(model) == deferred
        if not deferred:
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        engine = build_engine(model, cfg, platform, device, rank=rank, world_size=world_size,
                              group=dist.group.WORLD, horizon=8)
        actor = PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)
        actor.update(shard(batch, world_size)[rank], num_mini_batches=1, use_rollout_logprobs=False)
        out[deferred] = {"logprobs": engine.logprobs(batch).values.clone(),
                         "merged": engine_ranks.full_weights(engine),
                         "adapters": {k: v.clone() for k, v in engine.adapter_tensors()}}
    return out


@pytest.mark.slow  # one 2-rank world
def test_fsdp2_deferred_load_of_moe_adapters_equals_the_whole_load(qwen3_moe, tmp_path):
    """The sharded load finds the experts' weights under peft's nested wrappers
    (`experts.base_layer.base_layer.gate_up_proj`) and starts every adapter as the whole load does."""
    from gloo_world import run_world_ok

    ranks = run_world_ok(deferred_and_whole, 2, tmp_path, args=(qwen3_moe,), timeout_s=300, backend_timeout_s=240)
    for r in ranks.values():
        new, old = r[True], r[False]
        assert torch.equal(new["logprobs"], old["logprobs"])
        for group in ("merged", "adapters"):
            assert sorted(new[group]) == sorted(old[group]) and new[group]
            assert all(torch.equal(new[group][k], v) for k, v in old[group].items()), group
        dense_b = [v for k, v in new["adapters"].items() if "layers.1.mlp" in k and "lora_B" in k]
        assert len(dense_b) == 3 and all(v.abs().max() > 0 for v in dense_b)
