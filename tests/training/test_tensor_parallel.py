"""Tensor parallelism in training (actor.tensor_parallel_size) on real gloo ranks: tp=2, and
tp=2 x dp_shard=2 on 4 ranks, train exactly as one rank does (fp32): the same log-probs and
entropies, losses, gradient norms, and weights after the updates; the weight sync gathers one
tensor at a time; the vocabulary-parallel head never holds the full logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tp_ranks
from gloo_world import run_world_ok
from polyrl.training.config import ActorConfig
from polyrl.training.mesh import MeshError, ParallelDims
from polyrl.training.tensor_parallel import DEFAULT_PLAN, TensorParallelError, check_divisible, model_plan

TOL = 1e-5


def qwen3_moe_untied(path: Path) -> str:
    """A Qwen3-MoE: per-head q/k norms (the plan's replicated_with_grad_allreduce), an expert
    layer (attention sliced, experts whole on every tp rank) and a dense one (its MLP sliced), an
    untied head, and a vocabulary of 131 tokens, which tp=2 cannot split evenly."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(1)
    config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, mlp_only_layers=[1], vocab_size=131,
                            max_position_embeddings=128, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


def same_run(tp_rank: dict, one: dict) -> None:
    torch.testing.assert_close(tp_rank["logprobs"], one["logprobs"], rtol=TOL, atol=TOL)
    torch.testing.assert_close(tp_rank["entropy"], one["entropy"], rtol=TOL, atol=TOL)
    assert len(tp_rank["metrics"]) == len(one["metrics"])
    for a, b in zip(tp_rank["metrics"], one["metrics"]):
        for k in ("actor/loss", "actor/grad_norm", "actor/lr"):
            assert a[k] == pytest.approx(b[k], rel=TOL, abs=1e-9), (k, a, b)
    assert sorted(tp_rank["weights"]) == sorted(one["weights"])
    for k, w in one["weights"].items():
        # Adam divides by sqrt(v): summation-order noise (1e-9) in a ~0 gradient moves an element
        # by ~1e-6 (tests/training/test_fsdp2.py, same tolerance)
        torch.testing.assert_close(tp_rank["weights"][k], w, rtol=TOL, atol=TOL, msg=k)
    assert tp_rank["specs_match"] and tp_rank["live_peak"] == 1  # whole tensors, one at a time
    # the bucketed stream: every parameter above 2 KiB in row slices of at most 2 KiB (or one row,
    # an expert's), equal to the whole
    weights = tp_rank["weights"].values()
    big = sum(w.nbytes > 2048 and w.shape[0] > 1 for w in weights)
    bound = max(2048, max(w[0].nbytes for w in weights if w.dim() > 1))
    assert big >= 8 and tp_rank["sliced"] == big and tp_rank["largest_piece"] <= bound, (big, tp_rank["sliced"])
    assert sorted(tp_rank["streamed"]) == sorted(tp_rank["weights"])
    for k, w in tp_rank["weights"].items():
        assert torch.equal(tp_rank["streamed"][k], w), k


@pytest.mark.slow
def test_tp2_trains_as_one_rank_qwen3_moe_untied_uneven_vocab(tmp_path):
    model = qwen3_moe_untied(tmp_path / "qwen3-moe")
    one = tp_ranks.one_rank(model)
    assert one["metrics"][0]["actor/grad_norm"] > 0.5  # clipped to 0.5: the clip path runs too
    ranks = run_world_ok(tp_ranks.run, 2, tmp_path, args=(model, 2), timeout_s=300, backend_timeout_s=240)
    full = sum(w.numel() * 4 for w in one["weights"].values())
    for r in ranks.values():
        assert r["dims"] == "2 ranks: tp=2" and r["data_rank"] == 0  # both ranks on the same samples
        same_run(r, one)
        # every projection and the vocabulary sliced; the norms, the router and the experts whole
        whole = sum(w.numel() * 4 for k, w in one["weights"].items()
                    if ".mlp.experts." in k or ".mlp.gate." in k or "norm" in k)
        assert whole > 0.2 * full
        sliced = (full - whole) / 2 + whole
        assert 0.99 * sliced <= r["param_bytes"] <= 1.02 * sliced, (r["param_bytes"], sliced, full)


@pytest.mark.slow
def same_four_rank_run(r: dict, one: dict, full: int) -> None:
    """A 4-rank tp=2 run's rank equals one rank, holds about a quarter of the parameters, and
    its frozen reference and critic (value head whole over the sliced trunk) equal one rank's."""
    same_run(r, one)
    assert 0.24 * full <= r["param_bytes"] <= 0.27 * full, (r["param_bytes"], full)
    torch.testing.assert_close(r["reference"], one["reference"], rtol=TOL, atol=TOL)
    assert r["reference_trainable"] == 0
    for a, b in zip(r["critic"], one["critic"]):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=TOL), (k, a, b)


def test_tp2_by_dp_shard2_on_four_ranks_trains_as_one_rank(tiny_model, tmp_path):
    one = tp_ranks.one_rank(tiny_model, extras=True)
    ranks = run_world_ok(tp_ranks.run, 4, tmp_path, args=(tiny_model, 2, "fsdp2", tp_ranks.engine_ranks.BATCHES, True),
                         timeout_s=400, backend_timeout_s=300)
    full = sum(w.numel() * 4 for w in one["weights"].values())
    assert [r["data_rank"] for r in ranks.values()] == [0, 0, 1, 1]  # tp ranks are neighbours
    for r in ranks.values():
        assert r["dims"] == "4 ranks: dp_shard=2 x tp=2"
        same_four_rank_run(r, one, full)


def test_mesh_with_tp_keeps_tp_out_of_data_and_gradient_groups():
    dims = ParallelDims.from_actor(ActorConfig(world_size=4, strategy="fsdp2", tensor_parallel_size=2))
    assert (dims.dp_shard, dims.tp) == (2, 2) and dims.data_parallel_size == 2
    assert dims.groups() == [("dp_shard", (0, 2)), ("dp_shard", (1, 3)), ("tp", (0, 1)), ("tp", (2, 3))]
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert dims.data_group(1) == dims.gradient_group(1) == (1, 3) and dims.tensor_group(1) == (0, 1)
    assert dims.gradient_parallel_size == 2
    assert [dims.first_of_shard(r) for r in range(4)] == [True, False, True, False]  # the driver keeps one answer
    assert dims.describe() == "4 ranks: dp_shard=2 x tp=2"


def test_unsupported_tensor_parallel_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="actor.tensor_parallel_size=2 needs actor.strategy=fsdp2"):
        ActorConfig(world_size=2, tensor_parallel_size=2)  # ddp
    with pytest.raises(ValueError, match=r"actor.tensor_parallel_size=2 x actor.sequence_parallel_size=1 does not "
                                         r"divide actor.world_size=3"):
        ActorConfig(world_size=3, strategy="fsdp2", tensor_parallel_size=2)
    ActorConfig(world_size=4, strategy="fsdp2", tensor_parallel_size=2, sequence_parallel_size=2)  # they compose
    with pytest.raises(MeshError, match="needs actor.strategy=fsdp2"):
        ParallelDims.of("ddp", 2, tensor_parallel_size=2)


def test_the_divisibility_check_names_the_model_size():
    from transformers import Qwen2Config

    check_divisible(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=384), 2)
    with pytest.raises(TensorParallelError, match=r"actor.tensor_parallel_size=4 does not divide the model's "
                                                  r"num_key_value_heads=2"):
        check_divisible(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=384), 4)
    with pytest.raises(TensorParallelError, match="intermediate_size=6"):
        check_divisible(Qwen2Config(num_attention_heads=4, num_key_value_heads=4, intermediate_size=6), 4)


def test_plans_come_from_the_model_config_else_polyrls():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=64)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**small, head_dim=16))
    assert model_plan(qwen3)["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    llama = LlamaForCausalLM(LlamaConfig(**small))
    llama.config.base_model_tp_plan = None  # a model that ships none
    assert model_plan(llama) == DEFAULT_PLAN


def test_tp_refuses_a_lora_adapter_on_the_lm_head_naming_the_key():
    """The head is sliced by vocabulary rows and never called as a module: its adapter would not
    run (LoRA on the projections: tests/training/test_tensor_parallel_lora.py)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.training.lora import LoraConfig, apply_lora
    from polyrl.training.tensor_parallel import parallelize

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                         tie_word_embeddings=False))
    wrapped = apply_lora(model, LoraConfig(lora_rank=2, lora_target_modules=["q_proj", "lm_head"]))
    with pytest.raises(TensorParallelError, match="LoRA adapter on the LM head.*model.lora_target_modules"):
        parallelize(wrapped.get_base_model(), None, tp=2)


def test_vocab_parallel_head_in_chunks_equals_the_plain_log_softmax_and_its_gradients():
    """The chunked forward and recomputing backward of training/vocab_parallel.py on a one-rank
    group (the cross-rank reductions are the 2- and 4-rank tests'): rows in chunks of 3."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check_chunked_head(dist.group.WORLD)
    finally:
        if started:  # leave the process as it was for the tests that follow
            dist.destroy_process_group()


def _check_chunked_head(group) -> None:
    from polyrl.training.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (10,), generator=g)
    seed_lp, seed_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)

    lp, ent = vocab_parallel_logprobs(hidden, (weight, 0, group), targets, rows=3)
    grads = torch.autograd.grad((lp * seed_lp).sum() + (ent * seed_ent).sum(), (hidden, weight))
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    ref_lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_grads = torch.autograd.grad((ref_lp * seed_lp).sum() + (ref_ent * seed_ent).sum(), (hidden, weight))
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_memory_model_under_tp_keeps_the_state_and_slices_the_transient():
    from polyrl.training.memory_plan import QWEN25, Shape, tensor_parallel_rows, training_bytes

    s = Shape.from_config(QWEN25["Qwen2.5-72B"])
    one, two = (training_bytes(s, 16, tokens=32768, checkpointing=True, tp=tp) for tp in (1, 2))
    assert {k: one[k] for k in one if k != "transient"} == {k: two[k] for k in two if k != "transient"}
    rows = tensor_parallel_rows()
    transients = [r["transient_gb"] for r in rows]
    assert [r["tp"] for r in rows] == [1, 2, 4, 8] and transients == sorted(transients, reverse=True)
    # the residual checkpoints (T L h c) are not sliced: the transient stays above them
    assert transients[-1] > 32768 * 80 * 8192 * 2 / 1e9


def test_preflight_refuses_what_tp_cannot_slice_before_ray_starts():
    from transformers import Qwen2Config

    from polyrl.config import ConfigError
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_tensor_parallel

    cfg = JobConfig(actor={"strategy": "fsdp2", "world_size": 4, "tensor_parallel_size": 4})
    model = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
    with pytest.raises(ConfigError, match="actor.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        check_tensor_parallel(cfg, model)
    check_tensor_parallel(JobConfig(actor={"strategy": "fsdp2", "world_size": 2, "tensor_parallel_size": 2}), model)
    # LoRA composes with tp (tests/training/test_tensor_parallel_lora.py); offload does not yet
    check_tensor_parallel(JobConfig(actor={"strategy": "fsdp2", "world_size": 2, "tensor_parallel_size": 2},
                                    model={"lora_rank": 8}), model)
    offload = JobConfig(actor={"strategy": "fsdp2", "world_size": 2, "tensor_parallel_size": 2, "offload": True})
    with pytest.raises(ConfigError, match="actor.tensor_parallel_size=2 with actor.offload is not implemented"):
        check_tensor_parallel(offload, model)


def qwen3_heads_by_four(path: Path) -> str:
    """A tied Qwen3 whose 8 heads and 4 key-value heads divide by tp x sp = 4 (the tiny test
    model's 2 key-value heads do not), with per-head q/k norms and an uneven vocabulary of 131."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(2)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=8, intermediate_size=128, vocab_size=131, max_position_embeddings=128,
                         eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_tp2_by_sp2_on_four_ranks_trains_as_one_rank(tmp_path):
    """Tensor and sequence parallelism together: each rank's projections give it 4 of the 8
    query heads (H/tp), which its sp group's all-to-all splits into 2 over the whole row; the
    frozen reference and a critic on the same mesh too."""
    model = qwen3_heads_by_four(tmp_path / "qwen3")
    one = tp_ranks.one_rank(model, extras=True)
    ranks = run_world_ok(tp_ranks.run, 4, tmp_path,
                         args=(model, 2, "fsdp2", tp_ranks.engine_ranks.BATCHES, True, 2),
                         timeout_s=500, backend_timeout_s=400)
    full = sum(w.numel() * 4 for w in one["weights"].values())
    # one data shard: every rank the same samples; tp ranks (neighbours) the same token slice
    assert [r["data_rank"] for r in ranks.values()] == [0, 0, 0, 0]
    slices = [ranks[i]["token_slice"] for i in range(4)]
    T = slices[0][2]
    assert slices[0] == slices[1] == (0, T, T) and slices[2] == slices[3] == (T, 2 * T, T), slices
    for r in ranks.values():
        assert r["dims"] == "4 ranks: sp=2 x tp=2"
        # sliced over tp, each slice sharded over the other axis (the norms sharded only)
        same_four_rank_run(r, one, full)


def test_heads_must_divide_by_tp_times_sp_in_the_engine_and_the_preflight():
    """Under tp each rank holds H/tp heads and its sp group splits those: 4 heads and 2 key-value
    heads take tp=2 or sp=2 alone but not both (the rank's one key-value head cannot be split)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from polyrl.config import ConfigError
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_sequence_parallel
    from polyrl.training.ulysses import check_heads

    gqa = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
    model = SimpleNamespace(config=gqa)
    check_heads(model, 2)
    check_heads(SimpleNamespace(config=Qwen2Config(num_attention_heads=8, num_key_value_heads=4)), 2, tp=2)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel_size=2 x actor.tensor_parallel_size=2: model .* "
                                         r"has 4 attention heads and 2 key-value heads, which must both divide by 4"):
        check_heads(model, 2, tp=2)
    both = JobConfig(actor={"strategy": "fsdp2", "world_size": 4, "tensor_parallel_size": 2,
                            "sequence_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"actor.sequence_parallel_size=2 x actor.tensor_parallel_size=2: the model "
                                          r".* must both divide by 4"):
        check_sequence_parallel(both, gqa)
    check_sequence_parallel(both, Qwen2Config(num_attention_heads=8, num_key_value_heads=4))
