"""Hugging Face `datasets` directories (`save_to_disk`) as data files, and TRL's conversational
`messages` rows as prompts; the directories are written by the real `datasets` library."""

from __future__ import annotations

import json
import sys

import pytest
from verl_files import verl_rows, write_verl_parquet

from polyrl.data import DataConfig, DataFileError, load_dataset

datasets = pytest.importorskip("datasets", reason="the datasets extra: pip install 'polyrl[datasets]'")


def save_dict(path, **splits):
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
                         ).save_to_disk(str(path))
    return path


def chat_rows(*conversations):
    return [{"data_source": "arithmetic", "messages": messages, "reward_model": {"ground_truth": str(i)}}
            for i, messages in enumerate(conversations)]


USER = {"role": "user", "content": "1+1="}
ANSWER = {"role": "assistant", "content": "2"}


def test_a_dataset_dict_split_loads_like_the_same_rows_in_parquet(tmp_path, tiny_tokenizer):
    rows = verl_rows(4)
    write_verl_parquet(tmp_path / "train.parquet", rows)
    directory = save_dict(tmp_path / "gsm8k", train=rows, test=verl_rows(2, split="test"))
    from_dict = load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig())
    from_parquet = load_dataset([str(tmp_path / "train.parquet")], tiny_tokenizer, DataConfig())
    assert len(from_dict) == 4
    for a, b in zip(from_dict, from_parquet):
        assert (a.prompt_ids, a.prompt_text, a.ground_truth, a.extra_info, a.data_source) == \
            (b.prompt_ids, b.prompt_text, b.ground_truth, b.extra_info, b.data_source)
    assert len(load_dataset([f"{directory}:test"], tiny_tokenizer, DataConfig())) == 2


def test_a_single_dataset_directory_loads_without_a_split(tmp_path, tiny_tokenizer):
    datasets.Dataset.from_list(verl_rows(3)).save_to_disk(str(tmp_path / "one"))
    ds = load_dataset([str(tmp_path / "one")], tiny_tokenizer, DataConfig())
    assert [s.ground_truth for s in ds] == ["0", "1", "2"]
    with pytest.raises(DataFileError, match=r"holds one Dataset, not a DatasetDict.*without ':train'"):
        load_dataset([f"{tmp_path / 'one'}:train"], tiny_tokenizer, DataConfig())


def test_a_missing_split_lists_the_splits(tmp_path, tiny_tokenizer):
    directory = save_dict(tmp_path / "d", train=verl_rows(2), test=verl_rows(2))
    with pytest.raises(DataFileError) as err:
        load_dataset([f"{directory}:validation"], tiny_tokenizer, DataConfig())
    assert str(err.value) == (f"data file {directory} has no split 'validation'; its splits: "
                              f"train, test (e.g. {directory}:train)")
    with pytest.raises(DataFileError, match=r"is a DatasetDict with splits train, test: name one"):
        load_dataset([str(directory)], tiny_tokenizer, DataConfig())


def test_without_the_datasets_package_the_error_is_the_pip_command(tmp_path, tiny_tokenizer, monkeypatch):
    directory = save_dict(tmp_path / "d", train=verl_rows(2))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataFileError) as err:
        load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig())
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("needs the datasets package: pip install 'polyrl[datasets]'")


def test_bad_rows_in_a_split_are_located_like_file_rows(tmp_path, tiny_tokenizer):
    rows = verl_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": ""}]
    directory = save_dict(tmp_path / "d", train=rows)
    ds = load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig(on_bad_row="skip"))
    assert len(ds) == 2 and ds.num_bad_rows == 1
    with pytest.raises(DataFileError, match=rf"data file {directory}:train row 1: 'prompt' message 0 "
                                            r"has empty content; fix the row, or set data.on_bad_row=skip"):
        load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig(on_bad_row="error"))


def test_missing_columns_of_a_split_are_named(tmp_path, tiny_tokenizer):
    directory = save_dict(tmp_path / "d", train=[{"question": "1+1=", "answer": "2"}])
    with pytest.raises(DataFileError, match=rf"data file {directory}:train lacks column\(s\) data_source, "
                                            r"reward_model, prompt \(has answer, question\)"):
        load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig())


def test_conversational_rows_prompt_with_the_chat_up_to_the_last_user_turn(tmp_path, tiny_tokenizer):
    system = {"role": "system", "content": "add"}
    later = {"role": "user", "content": "2+2="}
    directory = save_dict(tmp_path / "chat", train=chat_rows(
        [USER],                                  # prompt-only
        [system, USER, ANSWER],                  # the reference answer is not shown to the policy
        [USER, ANSWER, later, {"role": "assistant", "content": "4"}],
    ))
    ds = load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig())
    assert [s.prompt_text for s in ds] == [
        "<|user|>1+1=\n<|assistant|>",
        "<|system|>add\n<|user|>1+1=\n<|assistant|>",
        "<|user|>1+1=\n<|assistant|>2\n<|user|>2+2=\n<|assistant|>",
    ]
    assert ds[2].raw_prompt == [USER, ANSWER, later]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_conversational_rows_work_in_every_format(fmt, tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = chat_rows([USER, ANSWER])
    path = tmp_path / f"chat.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert ds[0].prompt_text == "<|user|>1+1=\n<|assistant|>"


def test_a_prompt_column_wins_over_messages(tmp_path, tiny_tokenizer):
    row = dict(chat_rows([USER, ANSWER])[0], prompt="3+3=")
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert load_dataset([str(path)], tiny_tokenizer, DataConfig())[0].prompt_text == "3+3="


@pytest.mark.parametrize("messages,reason", [
    ([ANSWER], "'messages' has no user turn to answer"),
    ("1+1=", "'messages' must be a non-empty list of .* got str"),
    ([{"role": "user", "content": " "}], "'messages' message 0 has empty content"),
])
def test_bad_conversations_are_bad_rows(messages, reason, tmp_path, tiny_tokenizer):
    path = tmp_path / "chat.jsonl"
    rows = chat_rows([USER], messages)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig(on_bad_row="skip"))
    assert len(ds) == 1 and ds.num_bad_rows == 1
    with pytest.raises(DataFileError, match=rf"{path} line 2: {reason}"):
        load_dataset([str(path)], tiny_tokenizer, DataConfig(on_bad_row="error"))


def test_polyrl_train_names_the_missing_split_in_one_line(tmp_path, capsys, caplog):
    from polyrl.cli.main import main

    directory = save_dict(tmp_path / "d", train=verl_rows(2))
    code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}",
                 f"data.train_files=[{directory}:validation]"])
    err = capsys.readouterr().err + caplog.text
    assert code == 2, err
    assert "Traceback" not in err
    assert f"data file {directory} has no split 'validation'; its splits: train" in err


@pytest.mark.slow
def test_training_reads_a_datasets_directory(ray_session, tmp_path):
    """The embedded task's data as a DatasetDict: `polyrl train data.train_files=[DIR:train]`."""
    import pyarrow.parquet as pq

    from polyrl.builtin import resolve
    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    splits = {name: pq.read_table(resolve(f"builtin:arithmetic_{name}")).to_pylist()[:64]
              for name in ("train", "val")}
    directory = save_dict(tmp_path / "arith", **splits)
    cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        f"data.train_files=[{directory}:train]", f"data.val_files=[{directory}:val]",
        "trainer.total_steps=2", "trainer.val_every=0", "trainer.progress_bar=false",
        "logging.plot_at_end=false", f"trainer.output_dir={tmp_path / 'run'}"])
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2 and summary["initial_accuracy"] is not None


def test_a_damaged_datasets_directory_is_one_error(tmp_path, tiny_tokenizer):
    directory = save_dict(tmp_path / "d", train=verl_rows(2))
    (directory / "train" / "state.json").write_text("{ not json")
    with pytest.raises(DataFileError, match=rf"data file {directory} is not a readable datasets directory"):
        load_dataset([f"{directory}:train"], tiny_tokenizer, DataConfig())
