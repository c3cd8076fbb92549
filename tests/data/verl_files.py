"""Rows and parquet files laid out exactly as verl's preprocessing scripts write them."""

from __future__ import annotations


def verl_rows(n: int, data_source: str = "openai/gsm8k", split: str = "train") -> list[dict]:
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(n)
    ]


def write_verl_parquet(path, rows) -> None:
    """Explicit schema as verl's datasets have it: prompt = list<struct>, reward_model = struct."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
