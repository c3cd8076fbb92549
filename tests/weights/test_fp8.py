"""Block-wise FP8 quantization (polyrl.weights.fp8): numerics against a per-block reference and the
e4m3 error bound, which tensors stay in high precision, streaming, and the HF quantization config.

The bound, in units of the block's scale s = amax / 448: x = w / s lies in [-448, 448]. e4m3 has 3
mantissa bits, so rounding x to nearest moves it by at most half a step, 2^(e-4) <= |x| / 16 for
|x| in [2^e, 2^(e+1)), and at most 2^-10 in the subnormal range (step 2^-9). Hence per element
    |w - deq| <= max(|w| / 16, s / 1024)
and per block, where the top binade [256, 448] has step 32,
    |w - deq| <= 16 * s.
float32 rounds w / s and q * s once each (2^-24 relative of values up to 448 s), hence a slop term.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from polyrl.weights.fp8 import (
    FP8_BLOCK,
    FP8_QUANT_CONFIG,
    apply_fp8_quant_config,
    dequantize_block_fp8,
    is_quantizable,
    quantize_block_fp8,
    quantize_named_tensors,
)

F8 = torch.float8_e4m3fn
TINY = torch.finfo(torch.float32).tiny
SLOP = 2**-21


def reference_quantize(w: torch.Tensor, block=FP8_BLOCK):
    """The definition, one block at a time (the module must match it bit for bit)."""
    rows, cols = w.shape
    br, bc = block
    q = torch.empty(rows, cols, dtype=F8)
    s = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            scale = torch.clamp(blk.abs().max() / 448.0, min=TINY)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / scale).clamp(-448, 448).to(F8)
            s[i, j] = scale
    return q, s


def per_element_scale(s: torch.Tensor, shape, block=FP8_BLOCK) -> torch.Tensor:
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return s[rows][:, cols]


def assert_within_e4m3_bound(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block=FP8_BLOCK):
    w = w.float()
    scale = per_element_scale(s, w.shape, block)
    deq = dequantize_block_fp8(q, s, block)
    assert torch.equal(deq, q.float() * scale)
    assert torch.isfinite(deq).all()
    err = (w - deq).abs()
    element = torch.maximum(w.abs() / 16, scale / 1024) + w.abs() * SLOP
    assert (err <= element).all(), f"per-element bound exceeded by {(err / element).max().item():.6g}x"
    assert (err <= scale * (16 + 448 * SLOP)).all(), "per-block bound (16 * scale_inv) exceeded"


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype == F8 and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


SHAPES = [(1, 1), (127, 129), (128, 128), (300, 17), (17, 300), (64, 96), (129, 1), (256, 384)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_per_block_reference_and_bound(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    before = w.clone()
    q, s = quantize_block_fp8(w)
    assert torch.equal(w, before)  # the caller's weight is never modified
    ref_q, ref_s = reference_quantize(w)
    assert q.shape == w.shape and q.device == w.device
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert_bits_equal(q, ref_q)
    assert torch.equal(s, ref_s)
    assert_within_e4m3_bound(w, q, s)
    # Each block's largest element lands on the top of the e4m3 range (the range is fully used).
    blocks_amax = per_element_scale(s, shape) * 448
    top = w.float().abs() == blocks_amax
    assert top.any() and (q.float().abs()[top] == 448).all()


def test_other_block_sizes_match_the_reference():
    w = torch.randn(100, 70)
    for block in [(32, 32), (64, 16), (1, 70)]:
        q, s = quantize_block_fp8(w, block)
        ref_q, ref_s = reference_quantize(w, block)
        assert_bits_equal(q, ref_q)
        assert torch.equal(s, ref_s)
        assert_within_e4m3_bound(w, q, s, block)


def test_the_bound_is_tight_and_catches_a_wrong_scale():
    w = torch.rand(128, 128) * 2 - 1
    q, s = quantize_block_fp8(w)
    err = (w - dequantize_block_fp8(q, s)).abs().max()
    assert err > 0.9 * 16 * s.item()  # a looser bound would let real bugs through
    with pytest.raises(AssertionError):  # the same codes read with a scale 5% off break the bound
        assert_within_e4m3_bound(w, q, s * 1.05)


def test_zero_blocks_have_no_nan_and_dequantize_to_zero():
    w = torch.randn(256, 300)
    w[:128, 128:256] = 0  # one all-zero block among non-zero ones
    for x in (w, torch.zeros(130, 5), torch.zeros(1, 1, dtype=torch.bfloat16)):
        q, s = quantize_block_fp8(x)
        deq = dequantize_block_fp8(q, s)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert torch.isfinite(deq).all()
        assert (deq[x == 0] == 0).all()
        assert_within_e4m3_bound(x, q, s)
    q, s = quantize_block_fp8(w)
    assert s[0, 1] == TINY


@pytest.mark.parametrize("magnitude", [3e38, 1e30, 1e4, 1e-4, 1e-30, 1e-40])
def test_huge_and_tiny_magnitudes(magnitude):
    w = torch.randn(200, 130, dtype=torch.float64) * magnitude
    w = w.clamp(-3.4e38, 3.4e38).float()
    q, s = quantize_block_fp8(w)
    assert torch.isfinite(s).all()
    ref_q, ref_s = reference_quantize(w)
    assert_bits_equal(q, ref_q)
    assert torch.equal(s, ref_s)
    assert_within_e4m3_bound(w, q, s)


def test_blocks_scale_independently():
    """A per-tensor scale would flush a small-valued block to zero; per-block scales keep it."""
    w = torch.randn(256, 256) * 1e-4
    w[:128, :128] *= 1e8  # one block near 1e4, the others near 1e-4
    q, s = quantize_block_fp8(w)
    deq = dequantize_block_fp8(q, s)
    small = w[128:, 128:]
    rel = ((small - deq[128:, 128:]).abs() / small.abs().clamp(min=1e-12))
    big_s = s[0, 0].item()
    assert (small.abs() < big_s / 1024).float().mean() > 0.99  # below even one subnormal step of that scale
    assert (rel[small.abs() > s[1, 1] * 2**-6] <= 1 / 16 + SLOP).all()


def test_bf16_input_keeps_device_and_dequantizes_to_any_dtype():
    w = torch.randn(300, 17).to(torch.bfloat16)
    q, s = quantize_block_fp8(w)
    assert q.dtype == F8 and s.dtype == torch.float32
    d = dequantize_block_fp8(q, s, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == w.shape
    assert torch.equal(d, dequantize_block_fp8(q, s).to(torch.bfloat16))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        quantize_block_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        quantize_block_fp8(torch.ones(4, 4).to(F8))
    with pytest.raises(ValueError, match="block must be"):
        quantize_block_fp8(torch.ones(4, 4), (0, 128))
    w = torch.ones(256, 4)
    w[200, 1] = float("inf")
    with pytest.raises(ValueError, match="inf/nan values in 1 of 2 blocks"):
        quantize_block_fp8(w)
    with pytest.raises(ValueError, match="model.layers.3.mlp.up_proj.weight: weight has inf/nan"):
        list(quantize_named_tensors([("model.layers.3.mlp.up_proj.weight", w)]))
    with pytest.raises(ValueError, match="does not match weight"):
        dequantize_block_fp8(torch.zeros(256, 4, dtype=F8), torch.ones(1, 1))


# --- which tensors are quantized ------------------------------------------------------------------

@pytest.mark.parametrize("name, quantized", [
    ("model.layers.0.self_attn.q_proj.weight", True),
    ("model.layers.0.mlp.gate_proj.weight", True),
    ("model.layers.0.mlp.shared_expert.gate_proj.weight", True),
    ("model.layers.0.mlp.experts.3.down_proj.weight", True),
    ("model.layers.0.mlp.gate.weight", False),                   # MoE router (Qwen2-MoE, DeepSeek)
    ("model.layers.0.block_sparse_moe.gate.weight", False),      # MoE router (Mixtral)
    ("model.layers.0.mlp.shared_expert_gate.weight", False),
    ("model.layers.0.mlp.router.weight", False),
    ("model.embed_tokens.weight", False),
    ("lm_head.weight", False),
    ("model.norm.weight", False),
    ("model.layers.0.input_layernorm.weight", False),
    ("model.layers.0.self_attn.q_norm.weight", False),
    ("model.layers.0.self_attn.q_proj.bias", False),
])
def test_name_rules(name, quantized):
    assert is_quantizable(name, torch.ones(256, 128)) is quantized


def test_shape_and_dtype_rules_and_skip():
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not is_quantizable(name, torch.ones(128))
    assert not is_quantizable(name, torch.ones(2, 128, 128))  # fused 3-D experts pass through
    assert not is_quantizable(name, torch.ones(128, 128, dtype=torch.int8))
    assert not is_quantizable(name, torch.ones(128, 128).to(F8))
    assert not is_quantizable(name, torch.ones(128, 128).to(torch.float8_e5m2))
    assert is_quantizable(name, torch.ones(128, 128, dtype=torch.bfloat16))
    assert not is_quantizable(name, torch.ones(128, 128), skip=["self_attn"])
    assert not is_quantizable(name, torch.ones(128, 128), skip=("layers.0.",))
    assert is_quantizable(name, torch.ones(128, 128), skip=("layers.1.",))


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantized_names(state: dict) -> set[str]:
    return {n for n, t in state.items() if is_quantizable(n, t)}


def test_tiny_qwen2_state_dict(tiny_model):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert "model.embed_tokens.weight" in state and "lm_head.weight" in state  # tied, both listed
    assert quantized_names(state) == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in PROJ}


def test_tiny_llama_and_qwen2_moe_state_dicts():
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2MoeConfig

    common = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64}
    llama = AutoModelForCausalLM.from_config(LlamaConfig(**common, tie_word_embeddings=False)).state_dict()
    assert quantized_names(llama) == {f"model.layers.0.{p}.weight" for p in PROJ}

    moe = AutoModelForCausalLM.from_config(Qwen2MoeConfig(
        **common, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2)).state_dict()
    assert "model.layers.0.mlp.gate.weight" in moe and "model.layers.0.mlp.shared_expert_gate.weight" in moe
    attn = {f"model.layers.0.{p}.weight" for p in PROJ[:4]}
    shared = {f"model.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert quantized_names(moe) == attn | shared


# --- streaming -----------------------------------------------------------------------------------

def test_quantize_named_tensors_streams_lazily():
    state = {
        "model.embed_tokens.weight": torch.randn(128, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(200, 64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(200),
        "model.norm.weight": torch.randn(64),
    }
    taken = []

    def source():
        for item in state.items():
            taken.append(item[0])
            yield item

    stream = quantize_named_tensors(source())
    assert taken == []  # nothing happens before the consumer asks
    first = next(stream)
    assert taken == ["model.embed_tokens.weight"] and first[1] is state["model.embed_tokens.weight"]
    rest = list(stream)
    assert [n for n, _ in rest] == ["model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.0.self_attn.q_proj.weight_scale_inv",
                                    "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"]
    q, s = rest[0][1], rest[1][1]
    assert q.dtype == F8 and q.shape == (200, 64) and s.shape == (2, 1) and s.dtype == torch.float32
    assert rest[2][1] is state["model.layers.0.self_attn.q_proj.bias"]
    skipped = dict(quantize_named_tensors(state.items(), skip=["q_proj"]))
    assert all(skipped[n] is t for n, t in state.items()) and len(skipped) == len(state)
    with pytest.raises(TypeError, match="list of name substrings"):
        list(quantize_named_tensors(state.items(), skip=[1]))
    with pytest.raises(TypeError, match="list of name substrings"):  # a bare string is not a list
        is_quantizable("model.layers.0.mlp.up_proj.weight", torch.ones(4, 4), skip="visual.")


def test_round_trip_of_a_tiny_model_keeps_logits_close(tmp_path):
    """Quantize a real model (192-wide: full and edge blocks), load the dequantized weights back."""
    from tiny_models import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", hidden=192, layers=2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    original = {n: t.clone() for n, t in model.state_dict().items()}
    out = dict(quantize_named_tensors(original.items()))
    assert len(out) == len(original) + 14  # one scale_inv per linear weight (7 per layer)
    restored = {}
    for name, tensor in out.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == F8:
            assert_within_e4m3_bound(original[name], tensor, out[name + "_scale_inv"])
            tensor = dequantize_block_fp8(tensor, out[name + "_scale_inv"])
        restored[name] = tensor
    ids = torch.randint(2, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        model.load_state_dict(restored)
        got = model(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.1, rel  # quantization happened (5% here), and it kept the logits close
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"logits relative error {rel:.4f}, argmax agreement {agree:.3f}")
    assert agree > 0.8, agree


# --- HF quantization config ----------------------------------------------------------------------

def test_config_applied_to_a_saved_model_directory(tiny_model, tmp_path):
    from transformers import AutoConfig
    from transformers.quantizers import AutoQuantizationConfig

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)  # the session fixture stays untouched
    before = json.loads((model_dir / "config.json").read_text())
    assert apply_fp8_quant_config(model_dir) is True
    after = json.loads((model_dir / "config.json").read_text())
    assert after.pop("quantization_config") == FP8_QUANT_CONFIG
    assert after == before
    config = AutoConfig.from_pretrained(model_dir)
    assert config.quantization_config == FP8_QUANT_CONFIG
    hf = AutoQuantizationConfig.from_dict(config.quantization_config)  # transformers reads it as block FP8
    assert list(hf.weight_block_size) == [128, 128] and hf.activation_scheme == "dynamic"
    assert apply_fp8_quant_config(model_dir / "config.json") is True  # idempotent, file path accepted
    assert [p.name for p in model_dir.glob(".config.*")] == []  # no temp file left behind


def test_config_objects_and_the_missing_config_case(tiny_model, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    assert apply_fp8_quant_config(config) is True
    assert config.quantization_config == FP8_QUANT_CONFIG
    assert config.to_dict()["quantization_config"] == FP8_QUANT_CONFIG
    as_dict = {"model_type": "qwen2"}
    assert apply_fp8_quant_config(as_dict) is True and as_dict["quantization_config"] == FP8_QUANT_CONFIG
    as_dict["quantization_config"]["weight_block_size"].append(1)  # a copy, not the module constant
    assert FP8_QUANT_CONFIG["weight_block_size"] == [128, 128]

    empty = tmp_path / "no-config"
    empty.mkdir()
    assert apply_fp8_quant_config(empty) is False
    assert list(empty.iterdir()) == []
    assert apply_fp8_quant_config(tmp_path / "does-not-exist") is False
    assert apply_fp8_quant_config(None) is False
    with pytest.raises(TypeError, match="PretrainedConfig, a dict or a model path"):
        apply_fp8_quant_config(42)


def test_an_already_quantized_config_is_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quant_method='awq'.*rollout.quantization"):
        apply_fp8_quant_config(tmp_path)
    assert json.loads(cfg.read_text())["quantization_config"] == {"quant_method": "awq"}


# --- accelerator and benchmark -------------------------------------------------------------------

def _accelerator():
    from polyrl.platform import current_platform

    platform = current_platform()
    return platform if platform.ray_resource is not None and platform.device_count > 0 else None


@pytest.mark.gpu
@pytest.mark.skipif(_accelerator() is None, reason="needs a GPU/NPU")
def test_accelerator_matches_cpu_bit_for_bit():
    device = _accelerator().torch_device(0)
    for shape, dtype in [((300, 17), torch.float32), ((1408, 512), torch.bfloat16), ((129, 257), torch.float16)]:
        w = torch.randn(shape).to(dtype)
        q, s = quantize_block_fp8(w)
        dq, ds = quantize_block_fp8(w.to(device))
        assert dq.device == device and ds.device == device
        assert_bits_equal(dq.cpu(), q)
        assert torch.equal(ds.cpu(), s)
        assert torch.equal(dequantize_block_fp8(dq, ds).cpu(), dequantize_block_fp8(q, s))


def test_bench_fp8_quick_json(capsys):
    from polyrl.cli.main import main

    assert main(["bench", "fp8", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"params", "tensors", "reps", "threads", "block", "cpu", "ratio"} <= set(result)
    assert 20e6 < result["params"] < 40e6 and result["reps"] == 3 and result["block"] == [128, 128]
    for dtype, width in (("fp32", 4), ("bf16", 2)):
        row = result["cpu"][dtype]
        assert {"bytes", "out_bytes", "quant_bytes_per_s", "copy_bytes_per_s", "clone_bytes_per_s",
                "ratio", "clone_ratio", "quant_cpu_bytes_per_s", "cpu_ratio", "within_bound"} <= set(row)
        assert row["bytes"] == result["params"] * width
        assert row["out_bytes"] > result["params"]  # fp8 codes plus the float32 scales
        assert row["within_bound"] is True
        assert row["ratio"] == pytest.approx(row["quant_bytes_per_s"] / row["copy_bytes_per_s"])
        assert row["quant_bytes_per_s"] > 0 and row["cpu_ratio"] > 0
    assert result["ratio"] == result["cpu"]["bf16"]["ratio"]
