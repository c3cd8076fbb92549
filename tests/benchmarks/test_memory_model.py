"""polyrl/training/memory_plan.py: the arithmetic behind docs/scaling.md (benchmarks/memory_model.py
prints its tables and re-exports its names), and the parameter counts of the memory pre-flight
(polyrl/training/memory_floor.py)."""

from __future__ import annotations

import pytest

from polyrl.cli import bench
from polyrl.training import memory_floor, memory_plan


@pytest.fixture(scope="module")
def mm():
    return memory_plan


def test_the_benchmark_prints_the_package_model(capsys):
    script = bench.load("memory_model")
    for name in ("Shape", "QWEN25", "training_bytes", "layout", "predict_bench", "sync_seconds", "BANDWIDTH_GBPS"):
        assert getattr(script, name) is getattr(memory_plan, name), name
    assert script.main(["--json"]) == 0
    assert '"Qwen2.5-72B"' in capsys.readouterr().out


def test_parameter_counts_match_the_published_checkpoints(mm):
    # the safetensors totals of Qwen/Qwen2.5-{7B,32B,72B} (untied embeddings)
    counts = {name: mm.Shape.from_config(c).params for name, c in mm.QWEN25.items()}
    assert counts == {"Qwen2.5-7B": 7_615_616_512, "Qwen2.5-32B": 32_763_876_352, "Qwen2.5-72B": 72_706_203_648}


def test_the_same_formula_counts_what_transformers_builds(mm):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352)
    for tied in (True, False):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, tie_word_embeddings=tied))
        assert mm.Shape.from_config({**shape, "tie_word_embeddings": tied}).params == model.num_parameters()


@pytest.mark.parametrize("attention_bias,mlp_bias", [(False, False), (True, True)])
def test_the_formula_counts_llama_as_transformers_builds_it(mm, attention_bias, mlp_bias):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=352, attention_bias=attention_bias,
                         mlp_bias=mlp_bias)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = memory_floor.model_shape(config.to_dict())
    assert shape.counted is None  # by formula, not on the meta device
    assert shape.params == model.num_parameters()


def test_other_architectures_are_counted_on_the_meta_device(mm):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, Qwen3Config

    # Qwen3: q/k norms and no biases, not the formula's layout; layer_types must follow the layers
    config = Qwen3Config(vocab_size=512, hidden_size=128, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=352, head_dim=48)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for given in (config, config.to_dict()):  # the trainer's transformers config, the dry run's dict
        shape = memory_floor.model_shape(given)
        assert shape.counted == model.num_parameters()
        assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert memory_floor.model_shape({"model_type": "qwen2", "hidden_size": 8}) is None  # not a shape: not checked


def test_lora_adapter_count_is_peft_s(mm):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352)
    for targets in ("all-linear", ["q_proj", "v_proj"]):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**shape))
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert memory_floor.lora_params(mm.Shape.from_config(shape), 8, targets) == trainable, targets


def test_training_state_shards_and_load_today_does_not(mm):
    s = mm.Shape.from_config(mm.QWEN25["Qwen2.5-7B"])
    one, eight = mm.training_bytes(s, 1), mm.training_bytes(s, 8)
    for key in ("parameters", "gradients", "optimizer"):
        assert eight[key] == one[key] / 8
    assert one["parameters"] + one["gradients"] + one["optimizer"] == 16 * s.params  # fp32 master + AdamW
    assert mm.load_bytes_today(s, 1) == 8 * s.params  # the whole model + FSDP2's copy of it as the shard
    assert mm.load_bytes_today(s, 64) > 4 * s.params  # never below the whole model, whatever N


def test_kv_cache_per_token_of_qwen25_7b(mm):
    # 28 layers x (K, V) x 4 kv heads x 128 head dim x 2 bytes
    assert mm.Shape.from_config(mm.QWEN25["Qwen2.5-7B"]).kv_bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_72b_does_not_fit_8_gpus_without_offload_and_fits_64(mm):
    s = mm.Shape.from_config(mm.QWEN25["Qwen2.5-72B"])
    assert not mm.layout(s, 8, "colocated")["fits"]
    assert mm.layout(s, 8, "colocated", offload=True)["fits"]
    assert mm.layout(s, 64, "colocated")["fits"]
    # fsdp2 loads sharded in both layouts (colocated: a GPU engine fills from the first streamed sync):
    # each rank's fp32 shard + one bucket (+ the colocated engine's shard), not 291 GB of fp32 on every rank
    colocated, disaggregated = mm.layout(s, 64, "colocated"), mm.layout(s, 64, "disaggregated")
    assert colocated["load_today_fits"] and disaggregated["load_today_fits"]
    assert colocated["load_sharded_gb"] * 1e9 == mm.load_bytes_sharded(s, 64) + mm.SYNC_BUCKET_BYTES
    assert not mm.layout(s, 8, "disaggregated")["load_today_fits"]  # 4 trainers: 73 GB of fp32 shard
    with pytest.raises(ValueError, match="'hybrid' is not one of colocated, disaggregated"):
        mm.layout(s, 8, "hybrid")  # an earlier spelling is the config's alias, never a silent other layout


def test_sync_time_is_bytes_over_bandwidth(mm):
    s = mm.Shape.from_config(mm.QWEN25["Qwen2.5-7B"])
    seconds = mm.sync_seconds(s)
    for name, gbps in mm.BANDWIDTH_GBPS.items():
        assert seconds[name] == pytest.approx(2 * s.params / (gbps * 1e9))
