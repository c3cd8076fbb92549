"""One tokenizer loader and one dtype table for every layer (polyrl/modeling.py).

A model directory that ships its own tokenizer code gets that code only with
`trust_remote_code`, and a standalone replica honours the flag like the trainer does (the
engines used to load their tokenizer themselves and ignore it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyrl.builtin import resolve
from polyrl.modeling import DTYPES, load_tokenizer, torch_dtype
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.factory import build_disaggregated_engine
from polyrl.training import model_loading

SHIPPED = '''
from transformers import PreTrainedTokenizerFast


class ShippedTokenizer(PreTrainedTokenizerFast):
    """Tokenizer code that ships inside the model directory."""
'''


@pytest.fixture
def model_with_code(tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(resolve("builtin:tiny-arith"), model)
    (model / "shipped_tokenizer.py").write_text(SHIPPED)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="ShippedTokenizer",
                  auto_map={"AutoTokenizer": [None, "shipped_tokenizer.ShippedTokenizer"]})
    config_path.write_text(json.dumps(config))
    return model


def test_shipped_tokenizer_code_runs_only_when_trusted(model_with_code):
    assert type(load_tokenizer(model_with_code, trust_remote_code=True)).__name__ == "ShippedTokenizer"
    assert type(load_tokenizer(model_with_code)).__name__ != "ShippedTokenizer"
    trainer_side = model_loading.load_tokenizer(str(model_with_code), trust_remote_code=True)
    assert type(trainer_side).__name__ == "ShippedTokenizer"


def test_a_standalone_replica_honours_trust_remote_code(model_with_code):
    cfg = RolloutConfig(max_model_len=64)
    trusted = build_disaggregated_engine(cfg, str(model_with_code), torch.device("cpu"), trust_remote_code=True)
    plain = build_disaggregated_engine(cfg, str(model_with_code), torch.device("cpu"))
    assert type(trusted.tokenizer).__name__ == "ShippedTokenizer"
    assert type(plain.tokenizer).__name__ != "ShippedTokenizer"


def test_one_dtype_table_for_engines_and_trainer():
    from polyrl.rollout.native import engine

    assert model_loading.DTYPES is DTYPES and engine._resolve_dtype is torch_dtype
    assert torch_dtype("bf16") is torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"actor.param_dtype='int8' unsupported; choose one of float32, fp32"):
        torch_dtype("int8", "actor.param_dtype")
