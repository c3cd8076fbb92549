"""Turn a local GSM8K file into polyrl's (= verl's) prompt schema, written as parquet.

Input: JSONL or parquet rows with `question` and `answer`, where the answer ends with "#### n"
(the format of openai/gsm8k). Output, one row per problem:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": <full solution>, "question": question}}

Command (writes /tmp/gsm8k/train.parquet; the split defaults to the input's file name):

    python scripts/preprocess_gsm8k.py --input ~/data/gsm8k/train.jsonl --output-dir /tmp/gsm8k
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_ground_truth(answer: str) -> str:
    """The number after "#### ", commas removed ("1,000" -> "1000")."""
    found = _FINAL.search(answer)
    if found is None:
        raise ValueError(f"answer has no '#### <number>' line: {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def read_input(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"error: input file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def convert(rows: list[dict], split: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"row {index} lacks 'question' or 'answer' (has {sorted(row)})")
        try:
            truth = extract_ground_truth(row["answer"])
        except ValueError as exc:
            raise ValueError(f"row {index}: {exc}") from None
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": row["question"] + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {
                "split": split, "index": index, "answer": row["answer"], "question": row["question"],
            },
        })
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path, help="GSM8K .jsonl or .parquet file")
    parser.add_argument("--output-dir", required=True, type=Path, help="where <split>.parquet goes")
    parser.add_argument("--split", default=None, help="split name (default: from the file name)")
    args = parser.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq

    split = args.split or ("test" if "test" in args.input.stem else "train" if "train" in args.input.stem else args.input.stem)
    try:
        rows = convert(read_input(args.input), split)
    except ValueError as exc:
        raise SystemExit(f"error: {args.input}: {exc}") from None
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {len(rows)} rows to {out}")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
