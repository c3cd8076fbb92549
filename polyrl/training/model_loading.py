"""Load a policy from a local Hugging Face directory, with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import torch

from polyrl import modeling
from polyrl.builtin import resolve
from polyrl.modeling import DTYPES, torch_dtype  # noqa: F401  (DTYPES re-exported)
from polyrl.training import moe_experts, sharded_load, vlm


class ModelLoadError(RuntimeError):
    pass


def model_dir(path: str) -> Path:
    resolved = Path(resolve(path)).expanduser()
    if not resolved.is_dir():
        raise ModelLoadError(
            f"model.path: {path} is not a directory. Give a local Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files); polyrl never downloads models."
        )
    if not (resolved / "config.json").is_file():
        raise ModelLoadError(f"model.path: {resolved} has no config.json; is it a Hugging Face model directory?")
    return resolved


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The policy's tokenizer (`polyrl.modeling.load_tokenizer`, with the model directory
    checked first), padding with end-of-sequence when it has no pad token."""
    directory = model_dir(path) if not Path(resolve(path)).is_file() else Path(resolve(path))
    tok = modeling.load_tokenizer(directory, trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False, *,
                   deferred: bool = False, train_vision_tower: bool = False) -> torch.nn.Module:
    """The causal LM of `path`, on the CPU. `deferred`: on the meta device instead, weights read when
    the engine lays them out (`build_engine`; actor.strategy=fsdp2 reads each rank's shards only,
    training/sharded_load.py), unless the checkpoint cannot be read that way exactly (not
    safetensors, names or shapes transformers would convert): then loaded whole as without it.
    A deferred model goes to `build_engine` as is (no `.to(device)`, no broadcast: every rank
    reads the same files). A vision-language model (a config with a vision_config) loads whole
    through training/vlm.py, its vision tower frozen unless `train_vision_tower`. A Qwen3-MoE /
    Qwen2-MoE runs its experts through polyrl's grouped forward (training/moe_experts.py)."""
    from transformers import AutoModelForCausalLM

    directory = model_dir(path)
    if vlm.is_vlm_dir(directory):  # AutoModelForCausalLM does not map Qwen2-VL / Qwen2.5-VL
        try:
            return vlm.load_vlm(directory, torch_dtype(dtype), trust_remote_code,
                                train_vision_tower=train_vision_tower)
        except vlm.VLMError as exc:
            raise ModelLoadError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model.path: cannot load {directory}: {exc}") from None
    try:
        model = sharded_load.deferred_causal_lm(directory, torch_dtype(dtype), trust_remote_code) if deferred else None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
                attn_implementation="sdpa",
            )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {directory}: {exc}") from None
    moe_experts.use_grouped_experts(model)  # a Qwen3-MoE / Qwen2-MoE: polyrl's expert forward
    return model
