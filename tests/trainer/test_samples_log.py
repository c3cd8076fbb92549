"""Sample log: JSONL + readable text, bounded texts, resume truncation, rows from trainer samples."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from polyrl.trainer.samples_log import SampleLog, rows_from_batch, truncate


def row(i, **extra):
    return {"prompt": f"What is {i}+{i}?", "response": f"<answer>{2 * i}</answer>", "reward": 1.0,
            "acc": 1.0, "ground_truth": str(2 * i), **extra}


def test_write_jsonl_and_text(tmp_path):
    log = SampleLog(tmp_path)
    log.write(10, [row(1), row(2, data_source="arith")])
    log.write(15, [])  # nothing to write: no header either
    log.write(20, [row(3)])
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 10, 20]
    assert records[1]["data_source"] == "arith"
    text = (tmp_path / "samples.txt").read_text()
    assert text.startswith("===== step 10 =====\n--- sample 1/2 | reward 1 | acc 1 | ground truth 2 ---")
    assert "data_source arith" in text
    assert "[prompt]\nWhat is 3+3?\n[response]\n<answer>6</answer>" in text
    assert text.count("===== step") == 2


def test_long_texts_are_cut_with_a_marker(tmp_path):
    log = SampleLog(tmp_path, max_chars=100)
    log.write(1, [row(1) | {"response": "a" * 60 + "b" * 1000 + "c" * 40}])
    record = json.loads((tmp_path / "samples.jsonl").read_text())
    assert "[... 1000 characters cut ...]" in record["response"]  # keeps the first 66, last 34
    assert record["response"].startswith("a" * 60 + "b" * 6) and record["response"].endswith("c" * 34)
    assert len(record["response"]) < 150
    assert truncate("short", 100) == "short"


def test_rows_need_the_required_keys(tmp_path):
    with pytest.raises(ValueError, match="ground_truth"):
        SampleLog(tmp_path).write(1, [{"prompt": "p", "response": "r", "reward": 0, "acc": 0}])


def test_resume_keeps_earlier_steps_in_both_files(tmp_path):
    log = SampleLog(tmp_path)
    for step in (10, 20, 30):
        log.write(step, [row(step)])
    SampleLog(tmp_path, resume_step=20).write(30, [row(99)])
    steps = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30]
    text = (tmp_path / "samples.txt").read_text()
    assert text.count("===== step") == 3 and "What is 99+99?" in text and "What is 30+30?" not in text

    SampleLog(tmp_path)  # a fresh run in the same directory starts empty
    assert (tmp_path / "samples.jsonl").read_text() == "" and (tmp_path / "samples.txt").read_text() == ""


def test_rows_from_batch_one_per_prompt_first():
    groups, rewards = [0, 0, 1, 1, 2], [1.0, 0.0, 0.0, 1.0, 1.0]
    prompts = [SimpleNamespace(prompt_text=f"q{g}", ground_truth=g, data_source="arith") for g in range(3)]
    batch = SimpleNamespace(
        group=torch.tensor(groups), texts=[f"a{g}" for g in groups], rewards=torch.tensor(rewards),
        acc=torch.tensor(rewards), response_lengths=torch.tensor([2] * 5),
        stop_reasons=lambda: ["stop"] * 5, prompts=[prompts[g] for g in groups])
    rows = rows_from_batch(batch, 4)
    assert [r["prompt"] for r in rows] == ["q0", "q1", "q2", "q0"]
    assert rows[0] | {} == {"prompt": "q0", "response": "a0", "reward": 1.0, "acc": 1.0, "ground_truth": 0,
                            "data_source": "arith", "response_tokens": 2, "stop_reason": "stop"}
