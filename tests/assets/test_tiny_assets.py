"""The bundled tiny model, tokenizer and arithmetic data (the `polyrl train` default) are sound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import polyrl
from polyrl.data import synthetic

ASSETS = Path(polyrl.__file__).resolve().parent / "assets"
MODEL_DIR = ASSETS / "tiny-arith"
DATA_DIR = ASSETS / "data"
VERL_COLUMNS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def _rows(split: str) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(DATA_DIR / f"arithmetic_{split}.parquet")
    assert VERL_COLUMNS <= set(table.column_names)
    return table.to_pylist()


def test_asset_dir_is_small():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert size < 8 * 2**20, f"bundled assets are {size / 2**20:.1f} MiB"


def test_tokenizer_special_tokens_and_chars(tokenizer):
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<eos>" and tokenizer.eos_token_id == 1
    assert tokenizer.bos_token is None
    # One token per character for the task alphabet, no special tokens added.
    ids = tokenizer("37+48=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "37+48="
    assert tokenizer.pad_token_id not in ids and tokenizer.eos_token_id not in ids
    assert tokenizer("37+48=")["input_ids"] == ids  # add_special_tokens=True adds nothing either
    # Any text tokenizes and round-trips (byte-level fallback beyond ASCII).
    text = "Hello, world!\n\tx = 1 + 2 ~ é"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "37+48="


def test_tokenizer_json_matches_transformers(tokenizer):
    # Engines that load tokenizer.json directly must see the same ids as AutoTokenizer.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for text in ["37+48=", "99+99=", "a b\n", "<eos>12"]:
        assert raw.encode(text).ids == tokenizer(text)["input_ids"]


def test_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "37+48="}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == "37+48="
    full = msgs + [{"role": "assistant", "content": "85"}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == "37+48=85<eos>"
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] and cfg["eos_token"] == "<eos>" and cfg["pad_token"] == "<pad>"


def test_model_loads_and_matches_tokenizer(tokenizer, model):
    import torch
    from transformers import GenerationConfig

    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    cfg = model.config
    assert cfg.vocab_size == len(tokenizer)
    assert cfg.eos_token_id == tokenizer.eos_token_id and cfg.pad_token_id == tokenizer.pad_token_id
    assert cfg.tie_word_embeddings
    n = sum(p.numel() for p in model.parameters())
    assert 0.3e6 < n < 1.5e6
    gen = GenerationConfig.from_pretrained(MODEL_DIR)
    assert gen.eos_token_id == tokenizer.eos_token_id
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_warm_start_writes_answer_format(tokenizer, model):
    """Greedy decoding on a few val prompts gives digits then EOS (the warm start learned the format)."""
    import torch

    eos = tokenizer.eos_token_id
    ok = 0
    for r in _rows("val")[:16]:
        prompt = tokenizer(r["prompt"][0]["content"])["input_ids"]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(5):
                nxt = model(input_ids=ids).logits[0, -1].argmax().view(1, 1)
                ids = torch.cat([ids, nxt], 1)
                if nxt.item() == eos:
                    break
        resp = ids[0, len(prompt) :].tolist()
        ok += resp[-1] == eos and tokenizer.decode(resp[:-1]).isdigit()
    assert ok >= 12, f"only {ok}/16 greedy answers were digits then EOS"


def test_parquet_schema_and_disjoint():
    train, val = _rows("train"), _rows("val")
    assert len(train) >= 1000 and len(val) >= 200
    for split, rows in (("train", train), ("val", val)):
        for i, r in enumerate(rows[:50]):
            assert r["data_source"] == "arithmetic" and r["ability"] == "math"
            assert r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}]
            assert r["reward_model"]["style"] == "rule"
            assert r["extra_info"] == {"split": split, "index": i}
            a, b = r["prompt"][0]["content"].rstrip("=").split("+")
            assert str(int(a) + int(b)) == r["reward_model"]["ground_truth"]

    def key(r):
        a, b = r["prompt"][0]["content"].rstrip("=").split("+")
        return frozenset((int(a), int(b)))

    assert not {key(r) for r in train} & {key(r) for r in val}


def test_bundled_data_matches_generator():
    train, val = synthetic.generate_splits(n_train=len(_rows("train")), n_val=len(_rows("val")), seed=0)
    assert train == _rows("train") and val == _rows("val")


def test_generator_deterministic_and_disjoint():
    a = synthetic.generate_splits(n_train=300, n_val=100, seed=7)
    b = synthetic.generate_splits(n_train=300, n_val=100, seed=7)
    c = synthetic.generate_splits(n_train=300, n_val=100, seed=8)
    assert a == b and a != c
    train, val = a
    assert len(train) == 300 and len(val) == 100
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    row = train[0]
    assert set(row) == VERL_COLUMNS and row["extra_info"] == {"split": "train", "index": 0}


def test_generator_subtraction_and_writer(tmp_path):
    train, val = synthetic.generate_splits(n_train=50, n_val=20, seed=1, ops=("+", "-"))
    for r in train + val:
        q = r["prompt"][0]["content"]
        a, op, b = (q.rstrip("=").partition("+") if "+" in q else q.rstrip("=").partition("-"))
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == r["reward_model"]["ground_truth"]
        assert int(r["reward_model"]["ground_truth"]) >= 0
    paths = synthetic.write_arithmetic_dataset(tmp_path, n_train=40, n_val=10, seed=3)
    import pyarrow.parquet as pq

    assert pq.read_table(paths["train"]).num_rows == 40 and pq.read_table(paths["val"]).num_rows == 10
    with pytest.raises(ValueError, match="unsupported op"):
        synthetic.all_problems(ops=("*",))
