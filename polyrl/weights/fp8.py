"""Block-wise FP8 weight quantization for FP8 rollout (R4 in docs/architecture.md), in plain torch.

The format is the one DeepSeek-V3 checkpoints and HF's "fine-grained FP8" use, which vLLM, SGLang
and TensorRT-LLM load natively:

    x.weight            float8_e4m3fn, the original (rows, cols) shape
    x.weight_scale_inv  float32, (ceil(rows/128), ceil(cols/128)): one scale per 128x128 block

    weight ~= weight_fp8 * scale_inv   (block-wise; edge blocks may be smaller than 128x128)

`scale_inv` is the *dequantization* multiplier (the inverse of the quantization scale, hence the
name): amax(|block|) / 448, 448 being the largest finite e4m3 value, so every block uses the
whole e4m3 range. Activations are quantized by the engine at run time (`activation_scheme:
dynamic`), so nothing but the weights and these scales has to be sent.

What is quantized (`is_quantizable`): 2-D floating-point `*.weight` tensors of linear layers.
Kept in their original precision, because engines load them unquantized and they are small or
precision-critical:
    - 1-D tensors, biases, anything not ending in `.weight`, non-float or already-fp8 tensors;
    - embeddings (`embed` anywhere in the name: `embed_tokens`, `embed_positions`, ...);
    - the LM head (`lm_head`);
    - norms (`norm` in the module's own name: `input_layernorm`, `model.norm`, `q_norm`, ...);
    - MoE routers: `*.gate.weight` (not `gate_proj`), `*.shared_expert_gate.weight`, `*.router.*`;
    - every name containing one of the caller's `skip` substrings (HF's `modules_to_not_convert`
      matches the same way).
Fused 3-D expert tensors (transformers 5 keeps MoE experts as `experts.gate_up_proj` etc.) are
not 2-D and pass through; send per-expert 2-D weights to have them quantized.

Numerics: the block's amax is exact, scale_inv = amax / 448 in float32 (floored at float32's
smallest normal, so all-zero and denormal blocks never divide by zero), q = clamp(w / scale_inv,
-448, 448) rounded to nearest e4m3. Per element |w - q * scale_inv| <= max(|w| / 16, scale_inv /
1024) (3 mantissa bits; e4m3's subnormal step is 2^-9), and per block <= 16 * scale_inv (half the
step of e4m3's top binade [256, 448]). `tests/weights/test_fp8.py` checks both.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP8_BLOCK = (128, 128)
FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
SCALE_SUFFIX = "_scale_inv"

# Smallest normal float32: the floor of scale_inv (all-zero blocks, denormal weights).
_MIN_SCALE = torch.finfo(torch.float32).tiny

# Names that stay in high precision (see the module docstring). Matched with re.search.
_KEEP_PATTERNS = (
    re.compile(r"embed"),                           # embed_tokens, embed_positions, word_embeddings
    re.compile(r"(^|\.)lm_head(\.|$)"),             # the LM head (tied or not)
    re.compile(r"norm[^.]*\.weight$"),              # input_layernorm, model.norm, q_norm, k_norm
    re.compile(r"(^|\.)gate\.weight$"),             # MoE routers: mlp.gate, block_sparse_moe.gate
    re.compile(r"(^|\.)shared_expert_gate\.weight$"),  # Qwen2-MoE's shared-expert gate (hidden -> 1)
    re.compile(r"(^|\.)router(\.|$)"),              # routers named router (e.g. router.weight)
)


def _block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _high_precision(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() >= 2  # not int, not any 8-bit float


def _skip_list(skip: Iterable[str]) -> tuple[str, ...]:
    patterns = () if isinstance(skip, (str, bytes)) else tuple(skip)
    if isinstance(skip, (str, bytes)) or any(not isinstance(s, str) for s in patterns):
        raise TypeError(f"skip takes a list of name substrings such as ['visual.'], got {skip!r}")
    return patterns


def quantize_block_fp8(weight: torch.Tensor, block: Sequence[int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (float8_e4m3fn weight of the same shape, float32 scale_inv per block).

    Any float dtype in; computed in float32 on the weight's own device; no loop over blocks.
    Shapes not divisible by the block are zero-padded internally (zeros never raise a block's
    amax), so edge blocks get the scale of their real elements. Non-finite weights raise.
    """
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    if not _high_precision(weight):
        raise ValueError(f"block FP8 quantization needs a float16/bfloat16/float32 weight, got {weight.dtype}")
    br, bc = _block(block)
    rows, cols = weight.shape
    nbr, nbc = math.ceil(rows / br), math.ceil(cols / bc)
    w = weight.float()
    if (nbr * br, nbc * bc) != (rows, cols):
        w = torch.nn.functional.pad(w, (0, nbc * bc - cols, 0, nbr * br - rows))
    blocks = w.view(nbr, br, nbc, bc)
    # max(|x|) as max(max, -min): two fused reductions, no |x| temporary (3-4x faster on CPU).
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    if not torch.isfinite(amax).all():
        bad = int((~torch.isfinite(amax)).sum())
        raise ValueError(f"weight has inf/nan values in {bad} of {nbr * nbc} blocks; cannot quantize it to FP8")
    # Divide by a tensor, not the Python scalar: CUDA turns `x / scalar` into `x * (1 / scalar)`,
    # one ulp off IEEE division for most blocks, and the scales (then the FP8 values at rounding
    # edges) would differ between a GPU and a CPU quantizing the same weight. A tensor divisor is
    # true division on every device (measured on an H200: 43 of 56 scales differed before).
    scale_inv = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=_MIN_SCALE)
    scale = scale_inv[:, None, :, None]
    # Divide in place when `w` is already our own float32 copy (bf16/fp16 input or padded).
    scaled = blocks.div_(scale) if w is not weight else blocks / scale
    q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nbr * br, nbc * bc)
    if q.shape != weight.shape:
        q = q[:rows, :cols].contiguous()
    return q, scale_inv


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = FP8_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_block_fp8`: q * scale_inv broadcast over each block, as `dtype`."""
    br, bc = _block(block)
    rows, cols = q.shape
    nbr, nbc = math.ceil(rows / br), math.ceil(cols / bc)
    if tuple(scale_inv.shape) != (nbr, nbc):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                         f"with block {br}x{bc} (expected {(nbr, nbc)})")
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (q.float() * scale).to(dtype)


def is_quantizable(name: str, tensor: torch.Tensor, skip: Iterable[str] = ()) -> bool:
    """True for a 2-D float linear weight that FP8 rollout quantizes (rules in the module docstring)."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    if not _high_precision(tensor):
        return False
    if any(p.search(name) for p in _KEEP_PATTERNS):
        return False
    return not any(s in name for s in _skip_list(skip))


def quantize_named_tensors(named: Iterable[tuple[str, torch.Tensor]],
                           skip: Iterable[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs with every quantizable `x.weight` replaced by two entries,
    `x.weight` (fp8) then `x.weight_scale_inv` (float32); everything else passes through as is.

    A generator: one weight is quantized at a time, as the consumer asks for it, so a bucketed
    sender never holds the whole quantized model next to the original.
    """
    skip = _skip_list(skip)
    for name, tensor in named:
        if not is_quantizable(name, tensor, skip):
            yield name, tensor
            continue
        try:
            q, scale_inv = quantize_block_fp8(tensor)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        yield name, q
        yield name + SCALE_SUFFIX, scale_inv


def apply_fp8_quant_config(hf_config: Any) -> bool:
    """Set `quantization_config` to FP8_QUANT_CONFIG on an HF config, if the config exists.

    Accepts a transformers `PretrainedConfig`, a config dict, or a path (a model directory or its
    `config.json`, rewritten atomically). Returns False and changes nothing for None or a path
    without a config.json (R4: the config is applied only when the model's HF config exists).
    A config that is already quantized with another method raises: FP8 rollout starts from a
    high-precision checkpoint.
    """
    if hf_config is None:
        return False
    if isinstance(hf_config, (str, os.PathLike)):
        return _apply_to_file(Path(hf_config))
    if isinstance(hf_config, dict):
        _check_existing(hf_config.get("quantization_config"), "config dict")
        hf_config["quantization_config"] = copy.deepcopy(FP8_QUANT_CONFIG)
        return True
    if hasattr(hf_config, "to_dict"):  # transformers.PretrainedConfig, without importing transformers
        _check_existing(getattr(hf_config, "quantization_config", None), type(hf_config).__name__)
        hf_config.quantization_config = copy.deepcopy(FP8_QUANT_CONFIG)
        return True
    raise TypeError(f"apply_fp8_quant_config takes a PretrainedConfig, a dict or a model path, "
                    f"got {type(hf_config).__name__}")


def _apply_to_file(path: Path) -> bool:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        return False
    data = json.loads(config_file.read_text())
    _check_existing(data.get("quantization_config"), str(config_file))
    data["quantization_config"] = copy.deepcopy(FP8_QUANT_CONFIG)
    fd, tmp = tempfile.mkstemp(dir=config_file.parent, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, config_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _check_existing(existing: Any, where: str) -> None:
    if existing is None:
        return
    if hasattr(existing, "to_dict"):
        existing = existing.to_dict()
    method = existing.get("quant_method") if isinstance(existing, dict) else None
    if method != "fp8":
        raise ValueError(f"{where} already has quantization_config with quant_method={method!r}; FP8 rollout "
                         f"needs an unquantized (bfloat16/float16/float32) checkpoint: unset rollout.quantization "
                         f"for this model or start from its unquantized weights")
