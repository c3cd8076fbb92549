"""The memory model and the memory pre-flight know mixture-of-experts models (issue #44,
docs/moe.md "Memory and scaling"): total vs active parameters, experts per rank, the gathered
layer under expert parallelism, and the Qwen3 MoE models' published sizes."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main
from polyrl.training import memory_floor as mf
from polyrl.training import memory_plan as mp

# a small Qwen3-MoE whose layers differ: layer 1 dense (mlp_only_layers), the others expert layers;
# head_dim 32 with 4 heads at hidden 64 (heads x head_dim != hidden, as in Qwen3-30B-A3B)
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                 moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1],
                 decoder_sparse_step=1, tie_word_embeddings=False)
# Qwen2-MoE: a gated shared expert, biases on q/k/v, expert layers every second layer
QWEN2_MOE = dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=48,
                 shared_expert_intermediate_size=80, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
                 tie_word_embeddings=True)


def built_count(config: dict) -> int:
    """Parameters of the whole model transformers builds (on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(config)
    model_type = d.pop("model_type")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **d)).num_parameters()


@pytest.mark.parametrize("config", [QWEN3_MOE, QWEN2_MOE], ids=["qwen3_moe", "qwen2_moe"])
def test_the_formula_counts_what_transformers_builds(config):
    s = mf.model_shape(config)
    assert s.counted is None  # by formula: the meta count's 1-and-2-layer extrapolation misses mixed layers
    assert s.params == built_count(config)
    # one token uses its top-2 of 6 experts in each expert layer
    assert s.active_params == s.params - s.expert_layers * 4 * 3 * 64 * 48
    assert s.expert_layers == (3 if config is QWEN3_MOE else 2)
    assert mp.Shape.from_config({**config, "num_experts": 0}).experts == 0  # a dense config


def test_qwen3_moe_published_sizes():
    """Qwen3-30B-A3B and Qwen3-235B-A22B as their model cards give them: 30.5B / 3.3B active,
    235B / 22B active."""
    small = mp.Shape.from_config(mp.QWEN3_MOE["Qwen3-30B-A3B"])
    big = mp.Shape.from_config(mp.QWEN3_MOE["Qwen3-235B-A22B"])
    assert (round(small.params / 1e9, 1), round(small.active_params / 1e9, 1)) == (30.5, 3.4)
    assert (round(big.params / 1e9), round(big.active_params / 1e9)) == (235, 22)
    assert small.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2  # head_dim 128, not hidden / heads = 64


def test_expert_parallelism_splits_the_experts_and_the_gathered_layer_not_the_state():
    s = mp.Shape.from_config(mp.QWEN3_MOE["Qwen3-30B-A3B"])
    assert [s.experts_per_rank(ep) for ep in (1, 8, 128)] == [128, 16, 1]
    one_layer_experts = 128 * 3 * 2048 * 768
    assert s.gathered_layer_params(8) == s.layer_params - one_layer_experts * 7 // 8
    setting = mf.Setting(compute=2, reference=False, lora_targets="all-linear", engine="share", engine_dtype=2,
                         tensor_parallel=1, memory_share=0.5, device_bytes=80 * 2**30, on_device=True)
    knobs = mf.Knobs(world_size=64, strategy="fsdp2", offload=False, master=2, lora_rank=0, colocated_engine=False)
    whole, split = (mf.rank_floor(s, mf.replace(knobs, expert_parallel=ep), setting)["update"] for ep in (1, 8))
    for term in ("parameters", "gradients", "AdamW"):  # every expert is held once over the 64 ranks
        assert split[term] == whole[term] == pytest.approx({"AdamW": 4}.get(term, 2) * s.params / 64)
    # bf16 master over 64 ranks: the two gathered layers (bf16) set the step's temporaries; with
    # the experts split 8 ways a gathered layer is 7x smaller, below AdamW's temporary (2 P / 64)
    assert whole["step temporaries"] == 2 * 2 * s.layer_params
    assert 2 * 2 * s.gathered_layer_params(8) < 2 * s.params / 64 == split["step temporaries"]
    assert mf.describe_params(s, 8) == ("30.53B parameters (mixture-of-experts: 3.35B active per token; "
                                        "128 experts per layer, 16 per rank at actor.expert_parallel_size=8)")


def test_the_scaling_table_rows():
    rows = {(r["model"], r["gpus"], r["placement"], r["ep"]): r for r in mp.moe_scaling_rows()}
    r = rows[("Qwen3-30B-A3B", 16, "colocated", 8)]
    assert (r["experts_per_rank"], r["fits"]) == (16, True)
    assert r["gathered_layer_gb"] < rows[("Qwen3-30B-A3B", 16, "colocated", 1)]["gathered_layer_gb"] / 6
    # 235B's bf16 weights (470 GB) need an engine replica of 16 H100s: beyond one node of 8
    assert rows[("Qwen3-235B-A22B", 128, "disaggregated", 8)]["engine_gpus"] == 16
    assert not rows[("Qwen3-235B-A22B", 64, "disaggregated", 1)]["fits"]


def test_the_pre_flight_names_total_and_active_parameters(tmp_path, capsys):
    d = tmp_path / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**mp.QWEN3_MOE["Qwen3-30B-A3B"],
                                               "architectures": ["Qwen3MoeForCausalLM"],
                                               "max_position_embeddings": 32768}))
    argv = ["train", "--dry-run", "--json", "--platform", "h100", f"model.path={d}", "actor.strategy=fsdp2",
            "rollout.placement=standalone", "actor.world_size=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "its 30.53B parameters (mixture-of-experts: 3.35B active per token; 128 experts per layer, " \
           "all on every rank's shard) need at least" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bench_memory_moe_shape_and_its_prediction():
    """`polyrl bench memory --moe`: a Qwen3-MoE of about the requested size, whose largest synced
    tensor (the prediction's row-slice term) is a layer's fused experts."""
    from polyrl.cli.bench import load

    memory = load("memory")
    shape = memory.qwen3_moe_shape(20_000_000)
    s = mp.Shape.from_config({**shape, "tie_word_embeddings": True})
    assert shape["model_type"] == "qwen3_moe" and abs(s.params - 20e6) < 3e6
    assert s.active_params < s.params / 2  # top-2 of 8 experts
    fused = 4 * 8 * 2 * shape["moe_intermediate_size"] * shape["hidden_size"] / 2**20  # gate_up_proj, MiB
    assert fused > 4 * shape["vocab_size"] * shape["hidden_size"] / 2**20  # the largest tensor
    bucket = 0.95 * fused  # the fused experts travel as two row slices, both held while gathered
    train = mp.training_bytes(mp.moe_training_shape(s), 2, master=4, compute=4, tokens=256)
    held = (train["parameters"] + train["optimizer"]) / 2**20
    assert mp.predict_bench(shape, 2, 256, bucket)["sync_mib"] - held == pytest.approx(fused)
