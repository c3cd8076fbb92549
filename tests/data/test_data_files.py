"""Reading verl-schema Parquet / JSONL, prompt rendering, filtering, and bad-input errors."""

import json
import logging

import pytest
from verl_files import verl_rows, write_verl_parquet

from polyrl.config import ConfigError, load_config
from polyrl.data import DataConfig, DataFileError, PromptDataset, load_dataset, read_rows, render_prompt


def test_verl_parquet_loads_unchanged(tmp_path, tiny_tokenizer):
    path = tmp_path / "train.parquet"
    write_verl_parquet(path, verl_rows(3))
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert len(ds) == 3 and ds.num_dropped_overlong == 0
    s = ds[1]
    assert s.data_source == "openai/gsm8k" and s.ground_truth == "1" and s.index == 1
    assert s.extra_info == {"index": 1, "split": "train"}
    assert s.raw_prompt == [{"content": "q1", "role": "user"}]
    assert s.prompt_text == "<|user|>q1\n<|assistant|>"
    # one token per character, role markers single tokens, no extra BOS/EOS added
    assert tiny_tokenizer.convert_ids_to_tokens(s.prompt_ids) == ["<|user|>", "q", "1", "\n", "<|assistant|>"]


def test_jsonl_with_plain_string_prompts(tmp_path, tiny_tokenizer):
    path = tmp_path / "train.jsonl"
    rows = [{"data_source": "arithmetic", "prompt": "1+2=", "reward_model": {"ground_truth": "3"}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert ds[0].prompt_text == "1+2=" and tiny_tokenizer.decode(ds[0].prompt_ids) == "1+2="
    assert ds[0].extra_info is None


def test_files_concatenate_and_max_samples(tmp_path, tiny_tokenizer):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_verl_parquet(a, verl_rows(2))
    write_verl_parquet(b, verl_rows(3, data_source="math"))
    ds = load_dataset([str(a), str(b)], tiny_tokenizer, DataConfig())
    assert [s.index for s in ds] == [0, 1, 2, 3, 4] and ds.data_sources == {"openai/gsm8k", "math"}
    assert len(load_dataset([str(a), str(b)], tiny_tokenizer, DataConfig(max_samples=3))) == 3


def test_overlong_prompts_dropped_and_counted(tiny_tokenizer, caplog):
    rows = verl_rows(2) + [dict(verl_rows(1)[0], prompt=[{"role": "user", "content": "x" * 50}])]
    with caplog.at_level(logging.WARNING, logger="polyrl.data.dataset"):
        ds = PromptDataset(rows, tiny_tokenizer, max_prompt_length=10)
    assert len(ds) == 2 and ds.num_dropped_overlong == 1
    assert "dropped 1 of 3 prompts longer than data.max_prompt_length=10" in caplog.text


def test_all_dropped_is_an_error_naming_the_limit(tiny_tokenizer):
    with pytest.raises(DataFileError, match=r"all 2 were dropped by data.max_prompt_length=3"):
        PromptDataset(verl_rows(2), tiny_tokenizer, max_prompt_length=3)


def test_overlong_is_an_error_when_not_dropping(tiny_tokenizer):
    with pytest.raises(DataFileError, match=r"row 0: prompt has 5 tokens > data.max_prompt_length=4"):
        PromptDataset(verl_rows(1), tiny_tokenizer, max_prompt_length=4, drop_overlong_prompts=False)


def test_missing_file_named(tmp_path, tiny_tokenizer):
    with pytest.raises(DataFileError, match=f"{tmp_path}/nope.parquet does not exist"):
        load_dataset([str(tmp_path / "nope.parquet")], tiny_tokenizer, DataConfig())


def test_corrupt_parquet_named(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataFileError, match=f"{path} is not a readable parquet file"):
        read_rows(path)


def test_corrupt_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(verl_rows(1)[0]) + "\n{not json\n")
    with pytest.raises(DataFileError, match=f"{path} line 2: not valid JSON"):
        read_rows(path)


def test_missing_columns_named(tmp_path):
    path = tmp_path / "raw.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "#### 1"}]), path)
    with pytest.raises(DataFileError, match=f"{path} lacks column\\(s\\) data_source, reward_model, prompt"):
        read_rows(path)


def test_custom_prompt_key(tmp_path, tiny_tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"data_source": "x", "question": "hi", "reward_model": {"ground_truth": 1}}))
    with pytest.raises(DataFileError, match="lacks column\\(s\\) prompt .*data.prompt_key"):
        read_rows(path)
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig(prompt_key="question"))
    assert ds[0].prompt_text == "hi" and ds[0].ground_truth == 1


def test_reward_model_without_ground_truth(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"data_source": "x", "prompt": "p", "reward_model": {"style": "rule"}}))
    with pytest.raises(DataFileError, match="line 1: reward_model must be a mapping with 'ground_truth'"):
        read_rows(path)


def test_unsupported_suffix_and_empty_file(tmp_path):
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(DataFileError, match="unsupported format '.csv'"):
        read_rows(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataFileError, match="has no rows"):
        read_rows(tmp_path / "e.jsonl")


def test_chat_prompt_needs_chat_template(tiny_tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(NoTemplate(), [{"role": "user", "content": "x"}])
    # parquet struct fields that are unset (None) are dropped before templating
    text = render_prompt(tiny_tokenizer, [{"role": "user", "content": "x", "name": None}])
    assert text == "<|user|>x\n<|assistant|>"


def test_config_accepts_a_single_path_and_names_empty_train_files(tiny_tokenizer):
    assert load_config(DataConfig, overrides=["train_files=/a.parquet"]).train_files == ["/a.parquet"]
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(DataConfig, overrides=["train_batch_size=0"])
    with pytest.raises(DataFileError, match=r"data.train_files is empty; set data.train_files="):
        load_dataset([], tiny_tokenizer, DataConfig())
