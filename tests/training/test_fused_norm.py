"""polyrl/training/fused_norm.py: the RMSNorm autograd node against transformers' norm (values and
gradients, fp32), its fallbacks, and its survival of transformers' train/eval re-binding."""

from __future__ import annotations

import pytest
import torch

from polyrl.training import fused_norm


def _norm(cls_name: str, hidden: int):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = {"Qwen3MoeRMSNorm": Qwen3MoeRMSNorm, "Qwen2RMSNorm": Qwen2RMSNorm}[cls_name](hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.3 + 1)
    return norm


@pytest.mark.parametrize("cls_name,shape", [("Qwen3MoeRMSNorm", (3, 5, 48)), ("Qwen2RMSNorm", (2, 7, 4, 16))])
def test_fused_equals_transformers_norm(cls_name, shape):
    norm = _norm(cls_name, shape[-1])
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).requires_grad_()
    grad = torch.randn(shape, generator=g)
    results = []
    for fused in (False, True):
        if fused:
            assert fused_norm.use_fused_rms_norm(norm) == 1
        x.grad = norm.weight.grad = None
        y = norm(x)
        y.backward(grad)
        results.append((y.detach(), x.grad.clone(), norm.weight.grad.clone(), y.grad_fn.name()))
    (y0, gx0, gw0, node0), (y1, gx1, gw1, node1) = results
    assert node1 == "_RMSNormBackward" and node0 != node1  # the fused node really ran
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-5)


def test_fallback_outside_float32_and_under_autocast():
    """bf16 input (transformers' dtype promotion kept) and a bf16 module take the module's own forward."""
    norm = _norm("Qwen3MoeRMSNorm", 32)
    fused_norm.use_fused_rms_norm(norm)
    x = torch.randn(4, 32, requires_grad=True)
    y = norm(x.bfloat16())
    assert y.dtype == torch.float32 and y.grad_fn.name() != "_RMSNormBackward"  # fp32 weight * bf16
    assert norm.bfloat16()(x.bfloat16()).grad_fn.name() != "_RMSNormBackward"


def test_swap_survives_the_kernel_hub_rebinding():
    """transformers re-binds every norm's forward on a train/eval switch (with the kernels package
    installed); `use_fused_rms_norm` (called before each forward) swaps them back."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config)
    assert fused_norm.use_fused_rms_norm(model) == 2 * 4 + 1  # per layer: 2 hidden + q/k; the final
    model.eval()
    model.train()
    fused_norm.use_fused_rms_norm(model)
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeRMSNorm"]
    assert all(m.forward.__func__ is fused_norm._fused_forward for m in norms)
    ids = torch.randint(0, 64, (2, 5))
    out = model(ids).logits
    out.sum().backward()
    assert all(m.weight.grad is not None for m in norms)
