"""`rollout.lora_mode=adapter` against the real vLLM (its CPU build in CI: scripts/vllm_tier.sh):
the hybrid start (full weights into a LoRA-enabled engine), then adapters pushed the way the
policy pushes them (`polyrl.training.lora.adapter_named_tensors`), served greedily exactly as the
trainer's merged model (peft) predicts, a new version replacing the old, the base untouched."""

from __future__ import annotations

import pytest
import torch

from polyrl.builtin import resolve
from polyrl.rollout.base import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=True, ignore_eos=True)


def _hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve("builtin:tiny-arith"), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(vllm_available):
    """Hybrid placement with adapters: `from_model` copies the trainer's full weights into an
    engine started with `enable_lora` (the step that died in vLLM's post-processing)."""
    from polyrl.modeling import load_tokenizer
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.factory import build_colocated_engine

    # a tenth of host RAM: on the CPU build the share is of RAM, and half of it is often not free
    # on a shared machine (vLLM then refuses to start; docs/gpu_engines.md, "Memory on CPU")
    cfg = RolloutConfig(backend="vllm", placement="hybrid", lora_mode="adapter", dtype="float32",
                        max_model_len=64, max_num_seqs=16, enforce_eager=True, gpu_memory_utilization=0.1)
    path = resolve("builtin:tiny-arith")
    eng = build_colocated_engine(cfg, _hf_model(), load_tokenizer(path), torch.device("cpu"))
    yield eng
    eng.shutdown()


def _policy(seed: int | None):
    """The trainer's LoRA policy (rank 8, alpha 16: scaling 2); B random when `seed` is given
    (peft starts it at zero), so the adapter changes the model."""
    from polyrl.training.lora import LoraConfig, apply_lora

    policy = apply_lora(_hf_model(), LoraConfig(lora_rank=8))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return policy


def _merged(policy):
    """The model the trainer's merged path would ship: base + B @ A x alpha / rank."""
    from polyrl.training.lora import merged_named_weights

    merged = _hf_model()
    missing, unexpected = merged.load_state_dict(dict(merged_named_weights(policy)), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # tied head only
    return merged


@torch.no_grad()
def _greedy(model) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(STEPS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


@torch.no_grad()
def _max_logprob_diff(model, outs) -> float:
    worst = 0.0
    for prompt, group in zip(PROMPTS, outs):
        out = group[0]
        logits = model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = max(worst, (want - torch.tensor(out.logprobs)).abs().max().item())
    return worst


def _served(engine, version):
    outs = engine.generate_batch(PROMPTS, GREEDY)
    assert all(o.weight_version == version for g in outs for o in g)
    return outs, [g[0].token_ids for g in outs]


def test_adapter_versions_serve_the_trainers_merged_model(engine):
    from polyrl.training.lora import adapter_named_tensors

    base_tokens = _greedy(_hf_model())
    _, served = _served(engine, 0)
    assert served == base_tokens  # the full-weight start with LoRA enabled serves the base

    seen = {}
    for version, seed in ((1, 1), (2, 2)):
        policy = _policy(seed)
        engine.update_weights(list(adapter_named_tensors(policy)), version)
        assert engine.weight_version == version
        outs, served = _served(engine, version)
        merged = _merged(policy)
        assert served == _greedy(merged), f"version {version}: vLLM's adapter output is not the merged model's"
        assert served != base_tokens
        diff = _max_logprob_diff(merged, outs)
        print(f"vLLM LoRA adapter v{version} vs merged model: log-prob max abs diff {diff:.2e} (fp32)")
        assert diff < 1e-3
        seen[version] = served
    assert seen[2] != seen[1]  # the second version replaced the first

    # peft's starting adapter (B = 0) is the identity: the base weights were never touched
    engine.update_weights(list(adapter_named_tensors(_policy(None))), 3)
    _, served = _served(engine, 3)
    assert served == base_tokens


def test_full_weights_after_adapters(engine):
    """A full-weight update (restored, reloaded and re-packed layers under the LoRA wrappers)
    still works once adapters have been served, and keeps serving the current adapter."""
    from safetensors.torch import load_file

    from polyrl.training.lora import adapter_named_tensors

    policy = _policy(5)
    engine.update_weights(list(adapter_named_tensors(policy)), 10)
    _, want = _served(engine, 10)
    engine.update_weights(load_file(resolve("builtin:tiny-arith") + "/model.safetensors"), 11)
    _, served = _served(engine, 11)
    assert served == want == _greedy(_merged(policy))
