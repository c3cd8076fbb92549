"""Read prompt rows from Parquet or JSONL files in verl's schema, or from a Hugging Face `datasets`
directory (`DIR` or `DIR:SPLIT`, polyrl/data/hf_disk.py), with errors that name the file.

verl-prepared parquet files store `prompt` as a list of structs and `reward_model` /
`extra_info` as structs; `Table.to_pylist()` turns those into lists of dicts and dicts, the
same shape a JSONL file gives, so both formats load unchanged. A row without the prompt column
but with a chat `messages` column (TRL's conversational format) is prompted with that chat up to
its last user turn (polyrl/data/rows.py `with_chat_prompt`).

A file that cannot be read at all (missing, a directory, not parquet, no required column) is an
error; a row that cannot be used (bad JSON line, bytes that are not UTF-8, a bad prompt) is a bad
row, handled by `data.on_bad_row` (polyrl/data/rows.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.data import hf_disk, reasoning_gym
from polyrl.data.errors import DataFileError
from polyrl.data.rows import MESSAGES_KEY, BadRows, row_problem, with_chat_prompt
from polyrl.data.vision import anchor_image_paths

REQUIRED = ("data_source", "reward_model")
SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass
class SourceRow:
    where: str
    """"data file F row N" (parquet, JSON array: 0-based) or "data file F line N" (JSONL: 1-based,
    as editors count), for messages about this row."""
    data: dict[str, Any]


def read_rows(path: str | Path, prompt_key: str = "prompt", bad_rows: BadRows | None = None) -> list[dict[str, Any]]:
    """The usable rows of one file; bad rows raise, or are skipped and counted in `bad_rows`."""
    return [row.data for row in read_source_rows(path, prompt_key, bad_rows)]


def read_source_rows(path: str | Path, prompt_key: str = "prompt",
                     bad_rows: BadRows | None = None) -> list[SourceRow]:
    """The usable rows of one file, each with where it came from."""
    bad_rows = bad_rows if bad_rows is not None else BadRows("error")
    if reasoning_gym.is_spec(str(path)):  # generated rows, polyrl/data/reasoning_gym.py
        generated = reasoning_gym.generate_rows(str(path), prompt_key)
        rows = [SourceRow(f"data file {path} row {i}", row) for i, row in enumerate(generated)]
        return _usable_rows(str(path), rows, prompt_key, bad_rows)
    on_disk = hf_disk.parse_spec(str(path))
    if on_disk is not None:
        table = hf_disk.load_split(*on_disk)
        name = table.label
        _check_columns(name, set(table.columns), prompt_key)
        rows = [SourceRow(f"data file {name} row {i}", row) for i, row in enumerate(table.rows)]
        return _usable_rows(name, rows, prompt_key, bad_rows)
    path = _existing_file(Path(path).expanduser())
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows = _read_parquet(path, prompt_key)
    elif suffix in (".jsonl", ".json"):
        rows = _read_json(path, bad_rows)
        columns = set().union(*(r.data.keys() for r in rows)) if rows else set()
        _check_columns(path, columns, prompt_key)
    else:
        raise DataFileError(f"data file {path}: unsupported format '{suffix}'; use one of "
                            f"{', '.join(SUFFIXES)}, or a directory written by datasets' save_to_disk")
    # relative image paths are the data file's, like a dataset's other relative references
    rows = [SourceRow(r.where, anchor_image_paths(r.data, path.parent)) for r in rows]
    return _usable_rows(str(path), rows, prompt_key, bad_rows)


def _usable_rows(name: str, rows: list[SourceRow], prompt_key: str, bad_rows: BadRows) -> list[SourceRow]:
    if not rows and not bad_rows.count:
        raise DataFileError(f"data file {name} has no rows")
    good = []
    for row in rows:
        data, problem = with_chat_prompt(row.data, prompt_key)
        problem = problem or row_problem(data, prompt_key)
        if problem:
            bad_rows.add(row.where, problem)
        else:
            good.append(SourceRow(row.where, data))
    return good


def _existing_file(path: Path) -> Path:
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in SUFFIXES)[:5]
        example = f" (it holds {', '.join(inside)})" if inside else ""
        raise DataFileError(f"data file {path} is a directory, not a file nor one written by "
                            f"datasets' save_to_disk: list the .parquet / .jsonl files inside it "
                            f"instead{example}")
    if not path.is_file():
        raise DataFileError(f"data file {path} does not exist")
    return path


def _check_columns(path: Path | str, columns: set[str], prompt_key: str) -> None:
    prompt = () if MESSAGES_KEY in columns else (prompt_key,)  # a chat prompts when no prompt column
    missing = [c for c in (*REQUIRED, *prompt) if c not in columns]
    if missing and columns:
        raise DataFileError(
            f"data file {path} lacks column(s) {', '.join(missing)} "
            f"(has {', '.join(sorted(columns))}); polyrl reads verl's schema: data_source, "
            f"{prompt_key} (set data.prompt_key for another name, or give a chat '{MESSAGES_KEY}' "
            f"column), reward_model.ground_truth"
        )


def _read_parquet(path: Path, prompt_key: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"data file {path} is not a readable parquet file: {exc}") from None
    _check_columns(path, set(table.column_names), prompt_key)
    return [SourceRow(f"data file {path} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_json(path: Path, bad_rows: BadRows) -> list[SourceRow]:
    raw = path.read_bytes()
    if path.suffix.lower() == ".json" and raw.lstrip().startswith(b"["):
        return _read_json_array(path, raw, bad_rows)
    rows = []
    for no, line in enumerate(raw.splitlines(), 1):
        where = f"data file {path} line {no}"
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad_rows.add(where, f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at column "
                                f"{exc.start + 1}); re-encode the file as UTF-8")
            continue
        except json.JSONDecodeError as exc:
            bad_rows.add(where, f"not valid JSON: {exc}")
            continue
        _add_object(rows, where, value, bad_rows)
    return rows


def _read_json_array(path: Path, raw: bytes, bad_rows: BadRows) -> list[SourceRow]:
    """A .json file holding one array: a file-level document, so a syntax error is fatal."""
    try:
        values = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataFileError(f"data file {path} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                            f"offset {exc.start}); re-encode it as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise DataFileError(f"data file {path} is not valid JSON: {exc}") from None
    rows: list[SourceRow] = []
    for i, value in enumerate(values):
        _add_object(rows, f"data file {path} row {i}", value, bad_rows)
    return rows


def _add_object(rows: list[SourceRow], where: str, value: Any, bad_rows: BadRows) -> None:
    if isinstance(value, dict):
        rows.append(SourceRow(where, value))
    else:
        bad_rows.add(where, f"expected a JSON object, got {type(value).__name__}")
