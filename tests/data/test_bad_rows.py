"""Bad rows are found at load, not when their batch comes up: data.on_bad_row=skip|error."""

from __future__ import annotations

import json
import logging

import pytest
from verl_files import verl_rows, write_verl_parquet

from polyrl.data import DataConfig, DataFileError, load_dataset

BAD_PROMPTS = {
    "empty string": "",
    "empty content": [{"role": "user", "content": ""}],
    "no content": [{"role": "user"}],
    "list of strings": ["1+1="],
    "empty list": [],
}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_with(prompt, n_good=3):
    good = [{"data_source": "arithmetic", "prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(n_good)]
    return good[:1] + [{"data_source": "arithmetic", "prompt": prompt, "reward_model": {"ground_truth": "2"}}] + good[1:]


@pytest.mark.parametrize("kind", sorted(BAD_PROMPTS))
def test_bad_prompt_is_skipped_counted_and_located(kind, tmp_path, tiny_tokenizer, caplog):
    path = jsonl(tmp_path / "t.jsonl", rows_with(BAD_PROMPTS[kind]))
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert len(ds) == 3 and ds.num_bad_rows == 1
    assert all(s.prompt_ids for s in ds)
    assert f"{path} line 2" in caplog.text and "skipped 1 of 4 rows" in caplog.text


@pytest.mark.parametrize("kind,reason", [
    ("empty string", "'prompt' is an empty string"),
    ("empty content", "'prompt' message 0 has empty content"),
    ("no content", "'prompt' message 0 has no 'content'"),
    ("list of strings", "'prompt' message 0 is a str, not a {'role', 'content'} mapping (a plain prompt is one string"),
])
def test_bad_prompt_with_on_bad_row_error_names_file_and_line(kind, reason, tmp_path, tiny_tokenizer):
    path = jsonl(tmp_path / "t.jsonl", rows_with(BAD_PROMPTS[kind]))
    with pytest.raises(DataFileError) as err:
        load_dataset([str(path)], tiny_tokenizer, DataConfig(on_bad_row="error"))
    message = str(err.value)
    assert message.startswith(f"data file {path} line 2: {reason}") and "data.on_bad_row=skip" in message
    assert "\n" not in message


def test_prompt_rendering_to_zero_tokens_is_a_bad_row(tmp_path, tiny_tokenizer):
    # whitespace the tokenizer has no token for, and a template that renders nothing for it
    class Quiet:
        chat_template = "{% for m in messages %}{% endfor %}"

        def apply_chat_template(self, messages, **kwargs):
            return ""

        def __call__(self, texts, add_special_tokens=True):
            return tiny_tokenizer(texts, add_special_tokens=add_special_tokens)

    rows = [{"data_source": "a", "prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": 1}}]
    path = jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataFileError, match=r"line 1: the prompt renders to 0 tokens"):
        load_dataset([str(path)], Quiet(), DataConfig(on_bad_row="error"))


def test_parquet_message_without_content_is_located_by_row(tmp_path, tiny_tokenizer):
    rows = verl_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": None}]
    path = tmp_path / "t.parquet"
    write_verl_parquet(path, rows)
    with pytest.raises(DataFileError, match=rf"{path} row 1: 'prompt' message 0 has no 'content'"):
        load_dataset([str(path)], tiny_tokenizer, DataConfig(on_bad_row="error"))
    assert [s.ground_truth for s in load_dataset([str(path)], tiny_tokenizer, DataConfig())] == ["0", "2"]


def test_non_utf8_line_names_file_line_and_byte(tmp_path, tiny_tokenizer, caplog):
    good = [json.dumps(r).encode() for r in rows_with("1+1=")]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(good[:1] + [b'{"data_source": "a\xff"}'] + good[1:]) + b"\n")
    with pytest.raises(DataFileError, match=rf"{path} line 2: not valid UTF-8 \(byte 0xff at column 19\)"):
        load_dataset([str(path)], tiny_tokenizer, DataConfig(on_bad_row="error"))
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert len(ds) == 4 and ds.num_bad_rows == 1 and "skipped 1 of 5 rows" in caplog.text


def test_first_bad_rows_are_listed_and_the_rest_counted(tmp_path, tiny_tokenizer, caplog):
    rows = rows_with("1+1=", n_good=2) + [dict(rows_with("")[1]) for _ in range(7)]
    path = jsonl(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert ds.num_bad_rows == 7 and len(ds) == 3
    assert f"{path} line 8" in caplog.text and f"{path} line 9" not in caplog.text
    assert "(and 2 more)" in caplog.text


def test_all_rows_bad_is_an_error_with_an_example(tmp_path, tiny_tokenizer):
    path = jsonl(tmp_path / "t.jsonl", [rows_with("")[1]] * 2)
    with pytest.raises(DataFileError, match=rf"all 2 rows are bad .*e\.g\. data file {path} line 1"):
        load_dataset([str(path)], tiny_tokenizer, DataConfig())


def test_directory_as_data_file_says_it_is_a_directory(tmp_path, tiny_tokenizer):
    write_verl_parquet(tmp_path / "train.parquet", verl_rows(2))
    with pytest.raises(DataFileError, match=rf"{tmp_path} is a directory, not a file.*train.parquet"):
        load_dataset([str(tmp_path)], tiny_tokenizer, DataConfig())


def test_null_ground_truth_is_counted_and_warned(tmp_path, tiny_tokenizer, caplog):
    rows = rows_with("1+1=")
    rows[2]["reward_model"]["ground_truth"] = None
    path = jsonl(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert len(ds) == 4 and ds.num_null_ground_truth == 1
    assert f"1 of 4 rows have reward_model.ground_truth null (data file {path} line 3)" in caplog.text
