"""scripts/preprocess_gsm8k.py on a tiny GSM8K-format file; its output loads as a dataset."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polyrl.data import DataConfig, load_dataset
from polyrl.rewards import RewardManager, RewardRequest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_gsm8k.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "What is 999 + 1?", "answer": "999 + 1 = 1,000\n#### 1,000"},
]


def test_converts_jsonl_to_verl_schema(tmp_path, script, tiny_tokenizer):
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in ROWS))
    out = script.main(["--input", str(src), "--output-dir", str(tmp_path / "out")])
    assert out == tmp_path / "out" / "train.parquet"

    rows = pq.read_table(out).to_pylist()
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{
            "role": "user",
            "content": ROWS[0]["question"] + " Let's think step by step and output the final answer after \"####\".",
        }],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0, "answer": ROWS[0]["answer"], "question": ROWS[0]["question"]},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "1000"

    # the output is a dataset polyrl trains on, and its ground truth is what the scorer expects
    ds = load_dataset([str(out)], tiny_tokenizer, DataConfig())
    manager = RewardManager()
    result = manager.score([
        RewardRequest(s.data_source, f"... #### {s.ground_truth}", s.ground_truth, True) for s in ds
    ])
    manager.close()
    assert result.scores == [1.0, 1.0]


def test_parquet_input_and_split_from_name(tmp_path, script):
    import pyarrow as pa

    src = tmp_path / "gsm8k_test.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), src)
    out = script.main(["--input", str(src), "--output-dir", str(tmp_path)])
    assert out.name == "test.parquet"
    assert pq.read_table(out).to_pylist()[1]["extra_info"]["split"] == "test"


def test_bad_answer_names_row(tmp_path, script):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no final line"}))
    with pytest.raises(SystemExit, match="row 0: answer has no '#### <number>' line"):
        script.main(["--input", str(src), "--output-dir", str(tmp_path)])
