"""`polyrl bench grpo --profile`: the GRPO step's profile, its groups and phases summing to the step."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from polyrl.cli import bench


@pytest.fixture(scope="module")
def gp():
    bench.load("grpo")  # puts benchmarks/ on sys.path, as `polyrl bench grpo --profile` does
    import grpo_profile

    return grpo_profile


def profiled_events(gp):
    """A real Qwen2 (2 layers) under the same markers as the step: a no-grad forward plus a
    multinomial draw as "generate", then forward, backward and an AdamW step as "update"."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 6))
    with gp.module_markers(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(gp.STEP):
            with record_function(gp.GENERATE), torch.no_grad():
                logits = model(ids).logits[:, -1]
                with record_function(gp.SAMPLE):
                    torch.multinomial(torch.softmax(logits, -1), 1)
            with record_function(gp.UPDATE):
                model(ids, labels=ids).loss.backward()
                optimizer.step()
            linear = torch.nn.Linear(16, 8)  # one known matmul: forward addmm + backward 2 mm
            linear(torch.randn(5, 16, requires_grad=True)).sum().backward()
    return prof.events()


def test_breakdown_parts_sum_to_the_step_and_follow_the_markers(gp):
    events = profiled_events(gp)
    result = gp.breakdown(events)
    gp.check_sums(result)  # every op's self time in exactly one phase and group
    step = next(e for e in events if e.name == gp.STEP)
    assert result["step_ms"] == pytest.approx(step.cpu_time_total / 1e3)
    assert sum(sum(g.values()) for g in result["ms"].values()) == pytest.approx(result["step_ms"], rel=1e-9)
    ms = result["ms"]
    assert ms["generate"]["sampling"] > 0 and ms["update"]["sampling"] == 0
    assert ms["update"]["optimizer"] > 0 and ms["generate"]["optimizer"] == 0
    for phase in ("generate", "update"):
        for group in ("matmul", "attention", "norms/activations"):
            assert ms[phase][group] > 0, (phase, group)
    assert ms["rest"]["matmul"] > 0  # the Linear outside both phases
    # the Linear's three matmuls: 2 x 5 x 16 x 8 FLOPs each
    assert result["matmul_flops"]["rest"] == 3 * 2 * 5 * 16 * 8

    classifier = gp.Classifier(events)
    backward = [e for e in events if e.cpu_parent is not None
                and e.cpu_parent.name.startswith("autograd::engine::evaluate_function")]
    # a backward op takes its forward op's group through the sequence number: the norms' and the
    # attention's backward nodes are found, not left in "other"
    groups = {classifier.group(e) for e in backward}
    assert {"norms/activations", "attention", "matmul"} <= groups


def test_matmul_flops_of_onednn_packed_linears(gp):
    from torch.profiler import ProfilerActivity, profile

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available in this torch build")
    weight = torch.randn(24, 16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 4)
    x, other = torch.randn(4, 16), torch.randn(4, 24)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # the engine's two forms
        torch.ops.mkldnn._linear_pointwise(x, other, packed, None, "add")
    found = [gp.matmul_flops(e) for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
    assert found == [2 * 4 * 16 * 24] * 2


def test_bad_case_is_one_line(capsys):
    grpo = bench.load("grpo")
    with pytest.raises(SystemExit) as exc:
        grpo.main(["--profile", "7M:float32"])
    assert exc.value.code == 2
    assert "expected SIZE:DTYPE with SIZE in ['4M', '30M', 'moe']" in capsys.readouterr().err


@pytest.mark.slow  # three in-process GRPO steps of a tiny model: ~20-40 s on 2 busy cores
def test_profile_of_three_in_process_steps(gp):
    from _tiny import build_model

    from polyrl.data.synthetic import write_arithmetic_dataset

    shape = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_arithmetic_dataset(Path(tmp) / "data", n_train=64, n_val=8, seed=0)
        build_model(str(Path(tmp) / "m"), shape)
        result = gp.profile_step(str(Path(tmp) / "m"), files, Path(tmp) / "run", "bfloat16", 1)
    gp.check_sums(result)
    ms = result["ms"]
    assert ms["generate"]["sampling"] > 0 and ms["update"]["optimizer"] > 0
    assert result["matmul_flops"]["generate"] > 0 and result["matmul_flops"]["update"] > 0
    assert result["outside_step_ms"] == 0  # the in-process engine runs in the step's thread
    peaks = gp.best_peaks(gp.matmul_peaks(shape, "bfloat16", 6.0), gp.matmul_peaks(shape, "bfloat16", 6.0))
    summary = gp.summarize(result, shape, "bfloat16", 6.0, peaks)
    assert summary["torch_threads"] == 1 and summary["roofline_fraction_cpu_time"] is not None
    assert sum(summary["groups_share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert set(summary["timed_phases_s"]) >= {"generate", "update"}
    # the step's own matmul count and the profile's agree (one prompt token per character)
    assert summary["matmul"]["gflop"] == pytest.approx(summary["step_gflop"], rel=0.25)
    json.dumps(summary)
