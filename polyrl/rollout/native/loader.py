"""Read a local Hugging Face model directory into a `ModelSpec` and a dict of HF-named tensors.

Only configuration, tokenizer and rotary-frequency helpers come from `transformers`; they run at
load time. The decoder's forward never touches a transformers module (see `model.py`); a
vision-language model's vision tower is transformers' own module (see `vision.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrl.rollout.native.moe import KNOWN_MOE_ARCHITECTURES, MOE_ARCHITECTURES, MoeSpec, moe_spec
from polyrl.rollout.native.vision import VISION_ARCHITECTURES, VisionSpec, vision_spec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
    *VISION_ARCHITECTURES,
)
"""Models the native engine can run: decoders with pre-norm RMSNorm, RoPE, GQA and a gated MLP
(or mixture-of-experts blocks of the router shapes in moe.py), and the vision-language models
whose language model is one (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: vision.py)."""

_ARCHITECTURE_OF_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
}

_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
# RoPE variants whose frequencies do not depend on the running sequence length, so one table
# computed at load time serves every position.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the lean forward needs to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    inv_freq: torch.Tensor
    """RoPE inverse frequencies, float32, [head_dim // 2]."""
    rope_scaling: float
    """Post-processing factor applied to cos/sin (yarn); 1.0 otherwise."""
    vision: VisionSpec | None = None
    """The vision tower and M-RoPE of a vision-language model; None for a text-only one."""
    moe: MoeSpec | None = None
    """The experts and router of a mixture-of-experts model (moe.py); None for a dense one."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def resolve_model_dir(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path '{model_path}' is not a local directory; the native engine loads a "
            f"Hugging Face model directory (config.json + *.safetensors) and never downloads"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path '{model_path}' has no config.json")
    return path


def check_model_dir(model_path: str | Path) -> None:
    """Pre-flight: a model directory whose architecture the engine does not run raises the one-line
    ValueError `spec_from_config` raises (reads config.json only). A path that is not a model
    directory yet passes: the launch reports it."""
    path = Path(model_path).expanduser()
    if (path / "config.json").is_file():
        spec_from_config(load_config(path))


def load_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def spec_from_config(config: Any) -> ModelSpec:
    """Check the architecture is one we implement and pull out the shapes."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _ARCHITECTURE_OF_TYPE:
        # a config built in memory (a model made from its config, not loaded) names no architecture
        archs = [_ARCHITECTURE_OF_TYPE[config.model_type]]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and (any(a in KNOWN_MOE_ARCHITECTURES for a in archs)
                         or any(getattr(config, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts"))):
        raise ValueError(
            f"native engine: the mixture-of-experts architectures={archs or None} "
            f"(model_type={getattr(config, 'model_type', None)!r}) are not supported (their "
            f"router shape is not implemented); supported mixture-of-experts: {', '.join(MOE_ARCHITECTURES)} "
            f"(docs/moe.md)"
        )
    if arch is None:
        raise ValueError(
            f"native engine: unsupported model architectures={archs or None} "
            f"(model_type={getattr(config, 'model_type', None)!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    top = config
    if arch in VISION_ARCHITECTURES:  # the decoder's shapes live in the text config (transformers < 4.52: flat)
        config = getattr(config, "text_config", None) or config
    act = getattr(config, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"native engine: hidden_act={act!r} unsupported; supported: {_ACTIVATIONS}")
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("native engine: sliding-window attention is not supported")
    if arch == "MistralForCausalLM" and getattr(config, "sliding_window", None):
        if config.sliding_window < config.max_position_embeddings:
            raise ValueError("native engine: sliding-window attention is not supported")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if head_dim % 2 or num_heads % num_kv_heads:
        raise ValueError(
            f"native engine: head_dim={head_dim} must be even and num_attention_heads={num_heads} "
            f"a multiple of num_key_value_heads={num_kv_heads}"
        )
    inv_freq, rope_scaling = _rope_frequencies(config, head_dim)
    # q/k/v bias, no o_proj bias (Qwen2 and the VL models built on it)
    qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                     "Qwen2MoeForCausalLM")
    qkv_bias = (qwen2 and getattr(config, "qkv_bias", True)) or bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        hidden_act=act,
        tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        # Qwen2 has q/k/v bias but no o_proj bias; Llama's attention_bias covers o_proj too.
        o_bias=not qwen2 and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3MoeForCausalLM"),
        max_position_embeddings=config.max_position_embeddings,
        inv_freq=inv_freq,
        rope_scaling=rope_scaling,
        vision=vision_spec(top, arch, head_dim, _rope_parameters(config)) if arch in VISION_ARCHITECTURES else None,
        moe=moe_spec(config, arch),
    )


def _rope_parameters(config: Any) -> dict:
    # transformers 5 folds rope_theta/rope_scaling into rope_parameters; 4.x keeps them apart.
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def _rope_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "mrope":  # transformers 4's name for Qwen2-VL's default frequencies, split in sections
        rope_type = "default"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("native engine: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponent), 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"native engine: rope_type={rope_type!r} unsupported (its frequencies change with the "
            f"sequence length); supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in the directory (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model path '{model_dir}' has no *.safetensors weights (other formats unsupported)"
        )
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wanted = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in wanted]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def eos_token_ids(model_dir: Path | None, config: Any, tokenizer: Any) -> frozenset[int]:
    """Union of the end-of-sequence ids named by the generation config, model config and tokenizer."""
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)

    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        add(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    add(getattr(getattr(config, "text_config", None), "eos_token_id", None))  # vision-language configs
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def rope_tables(spec: ModelSpec, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [length, head_dim], computed in float32 like the HF reference.

    The sin table's first half is negated so that rotate_half(x) * sin == roll(x, d/2) * sin_signed,
    which turns RoPE into three element-wise ops.
    """
    pos = torch.arange(length, dtype=torch.float32)
    freqs = pos[:, None] * spec.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * spec.rope_scaling
    sin = emb.sin() * spec.rope_scaling
    half = spec.head_dim // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)

