"""Load a policy from a local Hugging Face directory, with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import torch

from polyrl.builtin import resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    from transformers import AutoTokenizer

    directory = model_dir(path) if not Path(resolve(path)).is_file() else Path(resolve(path))
    tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    directory = model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {directory}: {exc}") from None
    return model
