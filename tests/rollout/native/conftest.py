"""Fixtures over the tiny checkpoints built by `native_models` (session-scoped, temp dirs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from native_models import EOS, VOCAB, build_model_dir  # noqa: E402,F401

@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {a: build_model_dir(a, tmp_path_factory.mktemp(a)) for a in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def qwen3_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for a, d in model_dirs.items()}


@pytest.fixture
def engine(qwen3_dir):
    from polyrl.rollout.native.engine import NativeEngine

    return NativeEngine(qwen3_dir, max_model_len=128, max_num_seqs=32)
