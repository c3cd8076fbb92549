"""polyrl's expert forward (polyrl/training/moe_experts.py) against transformers' own on the same
Qwen3-MoE / Qwen2-MoE: a trainer update (log-probs, loss, gradient norm, weights after the step)
equal within 1e-5 in fp32, with gradient checkpointing and routing replay; LoRA on the experts
through peft's parametrization; the per-expert fallback; the autocast dtype; and a saved config
that does not carry the switch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import engine_ranks
from moe_models import MOE_ARCHS, build_moe_model
from polyrl.training import moe_experts
from polyrl.training.model_loading import load_causal_lm


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: build_moe_model(tmp_path_factory.mktemp(arch), arch) for arch in MOE_ARCHS}


def _engine(path: str, implementation: str, **overrides):
    """The PPO actor of engine_ranks on `path` with its experts run by `implementation`
    (polyrl's, as load_causal_lm switches them, or one of transformers')."""
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.algorithms.off_policy import OffPolicyConfig
    from polyrl.platform import get_platform
    from polyrl.training import build_engine
    from polyrl.workers.actor import PPOActor

    cfg = engine_ranks.actor_config("ddp", **overrides)
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    model = load_causal_lm(path, cfg.param_dtype)
    assert model.config._experts_implementation == moe_experts.GROUPED_EXPERTS  # switched on load
    if implementation != moe_experts.GROUPED_EXPERTS:
        model.set_experts_implementation(implementation)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    engine = build_engine(model, cfg, platform, device, horizon=8)
    return engine, PPOActor(engine, cfg, AlgorithmConfig(), OffPolicyConfig().resolve(on_policy=True), device)


def _train(path: str, implementation: str, **overrides) -> dict:
    engine, actor = _engine(path, implementation, **overrides)
    batch = engine_ranks.make_batch(seed=4, n=7)
    logprobs = engine.logprobs(batch).values.clone()
    metrics = actor.update(batch, num_mini_batches=1, use_rollout_logprobs=False)
    return {"logprobs": logprobs, "metrics": metrics, "weights": engine_ranks.full_weights(engine)}


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_moe", {}),
    pytest.param("qwen2_moe", {}, marks=pytest.mark.slow),
    # gradient checkpointing recomputes each layer inside backward; R2 records the old policy's
    # routes and replays them (two epochs), and the aux loss and the load metric come from the
    # router the switch leaves alone
    pytest.param("qwen3_moe", dict(gradient_checkpointing=True, router_replay="R2", router_aux_loss_coef=0.01),
                 marks=pytest.mark.slow),
])
def test_update_equals_transformers_experts_fp32(moe_dirs, arch, overrides):
    """Against transformers' default experts forward (its grouped one; the loop over experts is
    compared below, module against module)."""
    path = moe_dirs[arch]
    ours = _train(path, moe_experts.GROUPED_EXPERTS, **overrides)
    for theirs in (_train(path, "grouped_mm", **overrides),):
        assert (ours["logprobs"] - theirs["logprobs"]).abs().max().item() <= 1e-5
        for key in ("actor/loss", "actor/grad_norm", "moe/expert_load_max"):
            assert ours["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=1e-5, abs=1e-6), key
        for name, w in theirs["weights"].items():
            torch.testing.assert_close(ours["weights"][name], w, rtol=0, atol=1e-5)
    moved = [n for n, w in ours["weights"].items() if "experts" in n]
    assert moved and all(not torch.equal(ours["weights"][n], load_causal_lm(path).state_dict()[n]) for n in moved)


def test_lora_on_the_experts_applies_through_the_switched_forward(moe_dirs):
    """peft's ParamWrapper parametrizes gate_up_proj / down_proj around the experts' forward: the
    adapted forward and the adapters' gradients equal transformers' forward of the same model."""
    from polyrl.training.lora import apply_lora
    from polyrl.training.lora_config import LoraConfig

    path = moe_dirs["qwen3_moe"]
    ids = torch.randint(2, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    out = {}
    for implementation in (moe_experts.GROUPED_EXPERTS, "grouped_mm"):
        torch.manual_seed(0)
        model = apply_lora(load_causal_lm(path), LoraConfig(lora_rank=4))
        with torch.no_grad():  # non-trivial adapters, the same in both
            g = torch.Generator().manual_seed(1)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        base = model.get_base_model()
        if implementation != moe_experts.GROUPED_EXPERTS:
            base.set_experts_implementation(implementation)
        logits = model(ids).logits
        logits.float().logsumexp(-1).sum().backward()
        out[implementation] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.requires_grad and "experts" in n})
    (ours, our_grads), (theirs, their_grads) = out.values()
    assert our_grads and set(our_grads) == set(their_grads)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    for n, g in their_grads.items():
        assert g.abs().sum() > 0, n
        torch.testing.assert_close(our_grads[n], g, rtol=1e-5, atol=1e-6)
    # the adapters do change the experts' output (the parametrization is read, not bypassed)
    plain = load_causal_lm(path)(ids).logits
    assert (plain - ours).abs().max() > 1e-3


def _experts(hidden: int, intermediate: int, experts: int = 5):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                            num_experts_per_tok=3)
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.3)
        module.down_proj.normal_(0, 0.3)
    x = torch.randn(9, hidden, requires_grad=True)
    weights, ids = torch.rand(9, experts).softmax(-1).topk(3)
    ids[0] = torch.tensor([4, 0, 2])  # expert 3 gets no token at all in some draws; 1 keeps one
    return config, module, x, ids, weights.requires_grad_()


@pytest.mark.parametrize("hidden,intermediate", [(16, 8), (12, 6)])
def test_forward_and_gradients_equal_transformers_loop(hidden, intermediate):
    """(16, 8): the grouped kernel; (12, 6): rows of 24/48 bytes, which the grouped kernel's
    layout rule refuses, so one matmul per expert segment; both equal transformers' loop over
    experts (top-3, so three slots' sum)."""
    config, module, x, ids, weights = _experts(hidden, intermediate)
    assert moe_experts.grouped_kernel_runs(x, module.gate_up_proj, module.down_proj) == (hidden == 16)
    results = []
    moe_experts.register()
    for implementation in (moe_experts.GROUPED_EXPERTS, "eager"):
        config._experts_implementation = implementation
        module.zero_grad()
        x.grad = weights.grad = None
        y = module(x, ids, weights)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y.detach(), x.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_no_rows_and_a_broadcast_gradient():
    """No rows at all (a rank of expert parallelism that received none): zero gradients, in the
    graph; and a plain `.sum()`'s broadcast gradient, which the grouped kernel's backward
    refuses, handed on dense."""
    gate_up = torch.randn(3, 16, 8, requires_grad=True)
    down = torch.randn(3, 8, 8, requires_grad=True)
    x = torch.randn(0, 8, requires_grad=True)
    moe_experts.expert_mlp(x, [0, 0, 0], gate_up, down, F.silu).sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(gate_up.grad, torch.zeros_like(gate_up))
    assert torch.equal(down.grad, torch.zeros_like(down))
    x = torch.randn(5, 8, requires_grad=True)
    assert moe_experts.grouped_kernel_runs(x, gate_up, down)
    moe_experts.expert_mlp(x, [2, 0, 3], gate_up, down, F.silu).sum().backward()
    assert x.grad.abs().sum() > 0 and torch.equal(gate_up.grad[1], torch.zeros_like(gate_up[1]))


def test_under_autocast_the_experts_run_in_the_autocast_dtype():
    """actor.compute_dtype=bfloat16 on ddp (autocast): the expert products in bf16 as a Linear's
    would be, the fp32 weights' gradients fp32 (transformers' grouped path casts the input up to
    the weights and runs them in fp32)."""
    config, module, x, ids, weights = _experts(16, 8)
    moe_experts.register()
    config._experts_implementation = moe_experts.GROUPED_EXPERTS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x, ids, weights.bfloat16())
    y.float().sum().backward()
    assert module.gate_up_proj.grad.dtype == torch.float32
    gate_up, down = module.gate_up_proj.detach().bfloat16(), module.down_proj.detach().bfloat16()
    ref = torch.zeros(x.shape)
    for t in range(len(x)):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t].detach().bfloat16(), gate_up[e]).chunk(2)
            ref[t] += (F.linear(F.silu(gate) * up, down[e]) * weights[t, slot].bfloat16()).float()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    config._experts_implementation = "eager"
    fp32 = module(x, ids, weights).detach()  # no autocast: fp32 products
    assert (y.float() - fp32).abs().max() > 1e-4  # bf16's rounding, far above fp32's


def test_switch_is_not_saved_and_leaves_dense_models_alone(moe_dirs, tmp_path):
    from tiny_models import build_tiny_model

    model = load_causal_lm(moe_dirs["qwen2_moe"])
    assert model.config._experts_implementation == moe_experts.GROUPED_EXPERTS
    model.save_pretrained(str(tmp_path / "saved"))
    assert moe_experts.GROUPED_EXPERTS not in (tmp_path / "saved" / "config.json").read_text()
    assert "experts_implementation" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    dense = load_causal_lm(build_tiny_model(tmp_path / "dense"))
    assert not moe_experts.use_grouped_experts(dense)
