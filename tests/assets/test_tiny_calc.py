"""The bundled tool-calling model builtin:tiny-calc and the calculator data are sound and are
what scripts/build_tiny_tools_model.py writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from polyrl.agents.calculator import trace
from polyrl.agents.parsers import HermesParser, ToolCall
from polyrl.builtin import resolve

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(resolve("builtin:tiny-calc"))
RECIPE = json.loads((MODEL_DIR / "warm_start.json").read_text())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.training.model_loading import load_tokenizer

    return load_tokenizer("builtin:tiny-calc")


def test_a_call_is_few_tokens_and_decodes_to_what_the_parser_reads(tokenizer):
    call = HermesParser().format([ToolCall("calculator", {"expression": "9999*9999"})])
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 15  # tags and the call's constant JSON are one token each
    text = tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True)
    assert text == call and HermesParser().parse(text).calls == [ToolCall("calculator", {"expression": "9999*9999"})]
    # any other text still tokenizes byte by byte and round-trips
    other = 'Hello {"name": "x"} é\n'
    assert tokenizer.decode(tokenizer(other)["input_ids"]) == other


def test_tokenizer_json_matches_transformers(tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text = tokenizer.apply_chat_template(trace(1234, 567)["messages"], tokenize=False)
    assert raw.encode(text).ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_template_renders_calls_and_results(tokenizer):
    messages = trace(1234, 567)["messages"]
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False) == "1234*567="
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        '1234*567=<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234*567"}}\n</tool_call><eos>'
        "<tool_response>699678</tool_response>699678<eos>")
    # an OpenAI-style assistant message with `tool_calls` renders as the same Hermes text
    structured = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234*567"}}}]}]
    assert tokenizer.apply_chat_template(structured, tokenize=False) == \
        tokenizer.apply_chat_template(messages[:2], tokenize=False)


def test_model_config():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    assert cfg.model_type == "qwen2" and cfg.max_position_embeddings >= 256
    assert cfg.vocab_size == 265 and cfg.eos_token_id == 1 and cfg.tie_word_embeddings


def test_bundled_data_is_the_generators():
    """calculator_{train,val}.parquet are write_calculator_task's output for the recipe's seed."""
    import tempfile

    from polyrl.agents.calculator import write_calculator_task

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_calculator_task(Path(tmp), RECIPE["n_train"], RECIPE["n_val"], n_sft=0, seed=RECIPE["seed"])
        for split in ("train", "val"):
            assert paths[split].read_bytes() == Path(resolve(f"builtin:calculator_{split}")).read_bytes(), split


def _content(path: Path) -> bytes:
    """A file's bytes, less what records the installed library's version: transformers stamps
    `transformers_version` into the JSON files it writes, so a bundled file made under one release
    must still equal a fresh build under another (the asset, not the stamp, is under test)."""
    if path.suffix != ".json":
        return path.read_bytes()
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data.pop("transformers_version", None)
    return json.dumps(data, sort_keys=True).encode()


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(_content(p)).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_build_is_deterministic(tmp_path):
    """Two builds (a few SFT steps each) write the same bytes, and every file that does not depend
    on the SFT length (tokenizer, template, data) equals the bundled one."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("build_tiny_tools_model",
                                                  REPO / "scripts" / "build_tiny_tools_model.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    threads = torch.get_num_threads()
    try:
        digests = []
        for name in ("a", "b"):
            build.main(["--out-dir", str(tmp_path / name), "--copy-steps", "3", "--habit-steps", "2",
                        "--batch", "8", "--eval", "0"])
            digests.append(_digest(tmp_path / name))
    finally:
        torch.set_num_threads(threads)  # the build pins one thread
    assert digests[0] == digests[1]
    bundled = _digest(MODEL_DIR.parent)
    for name in [f"tiny-calc/{f}" for f in TOKENIZER_FILES] + ["data/calculator_train.parquet",
                                                                 "data/calculator_val.parquet"]:
        assert digests[0][name] == bundled[name], name
