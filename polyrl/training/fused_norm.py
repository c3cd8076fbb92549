"""RMSNorm as one autograd node on the CPU in float32 (Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE /
Llama / Mistral norms: `weight * x * rsqrt(mean(x^2) + eps)`).

transformers writes the norm as five element-wise ops (pow, mean, add, rsqrt, two muls), so
autograd keeps their intermediates and its backward is about ten [tokens, hidden] passes, each
writing a fresh buffer. `_RMSNorm` keeps the normalised rows and the per-row scale and computes the
backward in four passes: on the bench's MoE (6 layers: 13 hidden norms [64, 37, 384] and 12 q/k
head norms per update), one thread, a norm's forward + backward takes ~2 ms against ~3-4 ms
(docs/moe.md "Speed").

`use_fused_rms_norm(model)` swaps the forward of those norm modules before each forward of the
policy's log-prob head (training/logprobs.py), so gradient checkpointing's recompute runs it too. The
swapped forward takes the fused path only where it was tested: a CPU, float32 input and weight,
plain tensors (not DTensors: tensor parallelism's replicated norms keep transformers' forward),
outside torch.compile (inductor fuses the ops itself); anywhere else, e.g. bf16 under autocast,
whose dtype promotion it leaves as transformers has it, it calls the module's own forward.
Values equal transformers' within float32 rounding (the same formula, tests/training/
test_fused_norm.py).
"""

from __future__ import annotations

import types

import torch

NORMS = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "LlamaRMSNorm",
                   "MistralRMSNorm"})
"""Classes whose forward is exactly `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`
(not Gemma's `1 + weight`, nor gated norms)."""


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
        normed = x * scale
        ctx.save_for_backward(normed, scale, weight)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        normed, scale, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).reshape(-1, normed.shape[-1]).sum(0)
        grad_normed = grad * weight
        # d(x * s)/dx with s = rsqrt(mean(x^2) + eps): s * (g - n * mean(g * n)), n = x * s
        mean = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(normed.shape[-1])
        grad_x = grad_normed.sub_(normed * mean).mul_(scale) if ctx.needs_input_grad[0] else None
        return grad_x, grad_weight, None


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and weight.dtype == torch.float32 and type(hidden_states) is torch.Tensor
            and type(weight) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()):
        return _RMSNorm.apply(hidden_states, weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def use_fused_rms_norm(model: torch.nn.Module) -> int:
    """Swap the forward of `model`'s RMSNorm modules of the `NORMS` classes; how many. Called
    before every forward (training/logprobs.py `response_logprobs`): transformers' kernel hub
    re-binds each norm's forward whenever the model changes between train and eval mode
    (`PreTrainedModel.train` with the `kernels` package installed), which drops this swap; a
    call that finds every norm still swapped costs one attribute read per norm."""
    norms = getattr(model, "_polyrl_rms_norms", None)
    if norms is None:
        norms = [m for m in model.modules() if type(m).__name__ in NORMS and hasattr(m, "variance_epsilon")]
        model._polyrl_rms_norms = norms  # a plain list: not a submodule, not in the state dict
    for module in norms:
        if getattr(module.__dict__.get("forward"), "__func__", None) is not _fused_forward:
            module.forward = types.MethodType(_fused_forward, module)
    return len(norms)
