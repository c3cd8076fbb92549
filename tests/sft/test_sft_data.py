"""Chat files in verl's SFT schemas: rows become training rows (prompt = first token), bad rows
and over-long conversations are counted skips or one-line errors naming file and row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chat_tokenizers import CHATML, chat_tokenizer
from polyrl.data import DataFileError
from polyrl.sft import ChatEncoder, SFTDataConfig
from polyrl.sft.data import load_sft_dataset


def chat(*turns):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer(CHATML)


def test_rows_become_batch_rows_with_first_token_as_prompt(tmp_path, tok):
    rows = [{"messages": chat("hi", "hello")}, {"messages": chat("a", "b", "c", "d")}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    ds = load_sft_dataset([str(tmp_path / "c.parquet")], tok, SFTDataConfig(), 512)
    assert len(ds) == 2
    for i, row in enumerate(rows):
        enc = ChatEncoder(tok).encode(row["messages"])
        assert ds.batch.prompt_ids.row(i).tolist() == enc.input_ids[:1]
        assert ds.batch.response_ids.row(i).tolist() == enc.input_ids[1:]
        assert ds.batch.loss_mask.row(i).tolist() == enc.loss_mask[1:]
    assert ds.where[1].endswith("c.parquet row 1")


def test_prompt_response_schema(tmp_path, tok):
    path = write_jsonl(tmp_path / "pr.jsonl", [{"q": "2+2?", "a": "4"},
                                               {"q": [{"role": "system", "content": "s"},
                                                      {"role": "user", "content": "3+3?"}], "a": "6"}])
    ds = load_sft_dataset([path], tok, SFTDataConfig(prompt_key="q", response_key="a"), 512)
    masked = [[t for t, m in zip(ds.batch.response_ids.row(i).tolist(), ds.batch.loss_mask.row(i).tolist()) if m]
              for i in range(2)]
    assert [tok.decode(m) for m in masked] == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_bad_rows_are_counted_and_named(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": chat("ok", "fine")},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": "not a list"},
        "{not json",
        {"messages": chat("q", "a"), "tools": "[oops"},
    ])
    ds = load_sft_dataset([path], tok, SFTDataConfig(), 512)
    assert (len(ds), ds.bad_rows, ds.rows) == (1, 5, 6)
    log = caplog.text
    assert "bad.jsonl line 2: 'messages' has no assistant turn" in log
    assert "line 3: 'messages' message 0 has role 'robot', not one of system, user, assistant, tool" in log
    assert "line 5: not a UTF-8 JSON line" in log
    strict = write_jsonl(tmp_path / "strict.jsonl", [{"messages": chat("ok", "fine")},
                                                     {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataFileError, match=r"strict.jsonl line 2: 'messages' has no assistant turn.*on_bad_row=skip"):
        load_sft_dataset([strict], tok, SFTDataConfig(on_bad_row="error"), 512)


def test_missing_column_names_the_file_and_the_fix(tmp_path, tok):
    path = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "x", "data_source": "d"}])
    with pytest.raises(DataFileError, match=r"rl.jsonl lacks column\(s\) messages \(has data_source, prompt\); "
                                            "set data.messages_key"):
        load_sft_dataset([path], tok, SFTDataConfig(), 512)


def test_over_long_conversations_dropped_truncated_or_refused(tmp_path, tok):
    long_history = [{"role": "system", "content": "sys"}] + chat("q1" * 20, "a1" * 20, "q2", "a2")
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": chat("q", "a")},
                                                {"messages": long_history},
                                                {"messages": chat("x" * 200, "y")}])
    limit = 60
    dropped = load_sft_dataset([path], tok, SFTDataConfig(truncation="drop"), limit)
    assert (len(dropped), dropped.dropped_overlong, dropped.truncated) == (1, 2, 0)

    left = load_sft_dataset([path], tok, SFTDataConfig(truncation="left"), limit)
    assert (len(left), left.dropped_overlong, left.truncated) == (2, 1, 1)
    kept = tok.decode(left.batch.prompt_ids.row(1).tolist() + left.batch.response_ids.row(1).tolist())
    # the oldest exchange went; the system prompt and the last exchange stayed
    assert kept == tok.apply_chat_template([long_history[0], *long_history[3:]], tokenize=False)
    assert all(int(n) <= limit for n in left.batch.lengths)

    with pytest.raises(DataFileError, match=r"long.jsonl line 2: the conversation has \d+ tokens > "
                                            "data.max_length=60"):
        load_sft_dataset([path], tok, SFTDataConfig(truncation="error"), limit)


def test_nothing_left_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataFileError, match="no conversations left of 1 rows"):
        load_sft_dataset([path], tok, SFTDataConfig(), 512)


def test_datasets_directory_with_a_split(tmp_path, tok):
    """A `DatasetDict.save_to_disk` directory reads as DIR:SPLIT, like RL data (polyrl/data/hf_disk.py);
    a split it lacks is one error listing the splits it has."""
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": chat("hi", "hello")}, {"messages": chat("a", "b", "c", "d")}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "d"))
    ds = load_sft_dataset([f"{tmp_path / 'd'}:train"], tok, SFTDataConfig(), 512)
    assert len(ds) == 2
    enc = ChatEncoder(tok).encode(rows[1]["messages"])
    assert ds.batch.response_ids.row(1).tolist() == enc.input_ids[1:]
    with pytest.raises(DataFileError, match="train, test|test, train"):
        load_sft_dataset([f"{tmp_path / 'd'}:validation"], tok, SFTDataConfig(), 512)
