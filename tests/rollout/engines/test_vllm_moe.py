"""polyrl's vLLM adapter on a mixture-of-experts model (issue #44, docs/moe.md "vLLM"): vLLM's CPU
build serves a Qwen3-MoE and its sampled log-probs equal the trainer's (transformers) forward in
fp32. The model is the bundled tiny-moe's shape with 64-wide attention heads: vLLM's CPU attention
kernel refuses tiny-moe's head_dim 16 ("Unsupported CPU attention configuration: head_dim=16"),
which is the attention's limit, not the experts'. A weight sync keeps the CPU build's prepacked
experts right: polyrl's worker extension repacks them, which vLLM skips on an update."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyrl.builtin import resolve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """tiny-moe's config (8 experts, top-2, 3 expert layers) with 2 heads of 64, random weights,
    the bundled tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("qwen3-moe-hd64")
    src = resolve("builtin:tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(f"{src}/{name}", d / name)
    c = json.loads(open(f"{src}/config.json").read())
    c.update(head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    for key in ("torch_dtype", "dtype", "architectures"):
        c.pop(key, None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(c.pop("model_type"), **c))
    model.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def engine(vllm_available, moe_dir):
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.factory import build_disaggregated_engine

    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="float32", max_model_len=64,
                        max_num_seqs=16, enforce_eager=True)
    eng = build_disaggregated_engine(cfg, str(moe_dir), torch.device("cpu"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def model(moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()


def sampled_gap(engine, model) -> torch.Tensor:
    """|engine log-prob - transformers log-prob| of every sampled token (2 samples per prompt)."""
    from polyrl.rollout.base import SamplingParams

    outs = engine.generate_batch(PROMPTS, SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1,
                                                         logprobs=True, ignore_eos=True))
    diffs = []
    for prompt, group in zip(PROMPTS, outs):
        assert len(group) == 2
        for out in group:
            assert len(out.token_ids) == len(out.logprobs) == 12
            # vLLM's CPU build routes with the V1 model runner, which returns no routes (docs/moe.md)
            assert "routed_experts" not in out.extra
            ids = torch.tensor([prompt + list(out.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            ref = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            diffs.append((ref - torch.tensor(out.logprobs)).abs())
    return torch.cat(diffs)


def test_vllm_samples_a_qwen3_moe_with_the_trainer_s_logprobs(engine, model):
    gap = sampled_gap(engine, model)
    assert gap.max() < 1e-5, f"vLLM vs transformers log-prob gap {gap.max():.2e}"


def test_a_sync_keeps_the_experts_equal_to_the_trainer_s(engine, model):
    """vLLM 0.32's CPU experts kernel prepacks w13/w2 and skips the repack on a weight update;
    polyrl's worker extension unpacks before a sync and repacks after it (vllm_worker.py,
    `unpack_cpu_experts`). One sync of unchanged weights, then one of changed experts."""
    engine.update_weights(list(model.named_parameters()), 1)
    gap = sampled_gap(engine, model)
    assert gap.max() < 1e-5, f"after a sync of unchanged weights: vLLM vs transformers gap {gap.max():.2e}"

    probe = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    with torch.no_grad():
        old_logits = model(probe).logits
    torch.manual_seed(1)
    with torch.no_grad():
        changed = 0
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.add_(torch.randn_like(p) * 0.5 * p.std())
                changed += 1
        moved = (model(probe).logits - old_logits).abs().max()
    assert changed > 0 and moved > 1e-2, f"the expert change must move the log-probs ({changed} params, {moved:.2e})"
    engine.update_weights(list(model.named_parameters()), 2)
    gap = sampled_gap(engine, model)
    assert gap.max() < 1e-5, f"after a sync of changed experts: vLLM vs transformers gap {gap.max():.2e}"
