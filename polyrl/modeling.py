"""What every layer that touches a Hugging Face model directory shares: the dtype names and
the tokenizer loader.

Below both `polyrl.rollout` (engines) and `polyrl.workers` (the trainer's policy), so that a
dtype name means the same thing everywhere and `model.trust_remote_code` is honoured by
whichever process loads the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polyrl.builtin import resolve

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
"""Dtype names a config or an engine argument may use (long names and their short forms)."""


def torch_dtype(dtype: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """The torch dtype a name (or a torch.dtype, returned as is) stands for; `field` names the
    setting in the error."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"{field}={dtype!r} unsupported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a local model directory (or `builtin:` name, or a tokenizer file).
    `trust_remote_code` is transformers' flag: tokenizer code shipped in the directory runs only
    when it is set (`model.trust_remote_code`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(str(path))), trust_remote_code=trust_remote_code)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators, for what the run draws in this process."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
