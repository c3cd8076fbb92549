"""Read prompt rows from Parquet or JSONL files in verl's schema, with errors that name the file.

verl-prepared parquet files store `prompt` as a list of structs and `reward_model` /
`extra_info` as structs; `Table.to_pylist()` turns those into lists of dicts and dicts, the
same shape a JSONL file gives, so both formats load unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUIRED = ("data_source", "reward_model")
SUFFIXES = (".parquet", ".jsonl", ".json")


class DataFileError(ValueError):
    """A data file that cannot be used; the message names the file and what is wrong."""


def read_rows(path: str | Path, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """All rows of one file, checked for the columns polyrl needs."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFileError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows = _read_parquet(path, prompt_key)
    elif suffix in (".jsonl", ".json"):
        rows = _read_json(path)
        columns = set().union(*(r.keys() for r in rows)) if rows else set()
        _check_columns(path, columns, prompt_key)
    else:
        raise DataFileError(f"data file {path}: unsupported format '{suffix}'; use one of {', '.join(SUFFIXES)}")
    if not rows:
        raise DataFileError(f"data file {path} has no rows")
    for i, row in enumerate(rows):
        _check_row(path, i, row, prompt_key)
    return rows


def _check_columns(path: Path, columns: set[str], prompt_key: str) -> None:
    missing = [c for c in (*REQUIRED, prompt_key) if c not in columns]
    if missing and columns:
        raise DataFileError(
            f"data file {path} lacks column(s) {', '.join(missing)} "
            f"(has {', '.join(sorted(columns))}); polyrl reads verl's schema: data_source, "
            f"{prompt_key} (set data.prompt_key for another name), reward_model.ground_truth"
        )


def _read_parquet(path: Path, prompt_key: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"data file {path} is not a readable parquet file: {exc}") from None
    _check_columns(path, set(table.column_names), prompt_key)
    return table.to_pylist()


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(f"data file {path} is not valid JSON: {exc}") from None
    else:
        rows = []
        for no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataFileError(f"data file {path} line {no} is not valid JSON: {exc}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFileError(f"data file {path} row {i}: expected an object, got {type(row).__name__}")
    return rows


def _check_row(path: Path, i: int, row: dict[str, Any], prompt_key: str) -> None:
    if not isinstance(row.get("data_source"), str):
        raise DataFileError(f"data file {path} row {i}: data_source must be a string, got {row.get('data_source')!r}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataFileError(
            f"data file {path} row {i}: reward_model must be a mapping with 'ground_truth', "
            f"got {reward_model!r}"
        )
    prompt = row.get(prompt_key)
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
        raise DataFileError(
            f"data file {path} row {i}: '{prompt_key}' must be a string or a non-empty list of "
            f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
        )
