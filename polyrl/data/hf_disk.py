"""Directories written by Hugging Face `datasets` (`Dataset.save_to_disk`,
`DatasetDict.save_to_disk`), read through the `datasets` library itself (an optional extra).

A path names one table: `DIR` for a directory holding one `Dataset`, `DIR:SPLIT` for one split of
a `DatasetDict`. The rows come out as plain dicts and lists (`Dataset.to_list()`), the same shape
`pyarrow.Table.to_pylist()` gives for Parquet, so the row checks downstream are the same for every
format (polyrl/data/files.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.data.errors import DataFileError

PIP_INSTALL = "pip install 'polyrl[datasets]'"

DICT_MARKER = "dataset_dict.json"
"""Written by `DatasetDict.save_to_disk` next to one sub-directory per split."""
DATASET_MARKERS = ("state.json", "dataset_info.json")
"""Written by `Dataset.save_to_disk` next to the Arrow shards."""


@dataclass
class DiskSplit:
    """One table of a `datasets` directory."""

    label: str
    """How messages name it: "DIR" or "DIR:SPLIT"."""
    columns: list[str]
    rows: list[dict[str, Any]]


def is_datasets_dir(path: Path) -> bool:
    """Whether `path` was written by `save_to_disk` (a Dataset or a DatasetDict)."""
    if not path.is_dir():
        return False
    return (path / DICT_MARKER).is_file() or all((path / m).is_file() for m in DATASET_MARKERS)


def parse_spec(spec: str) -> tuple[Path, str | None] | None:
    """(directory, split or None) when `spec` names a `datasets` directory, `DIR` or `DIR:SPLIT`;
    None for anything else (a file, or a path that does not exist)."""
    path = Path(spec).expanduser()
    if is_datasets_dir(path):
        return path, None
    head, sep, split = spec.rpartition(":")
    # a split name never holds a path separator; "C:/x" style paths are not split names either
    if sep and head and split and "/" not in split and is_datasets_dir(Path(head).expanduser()):
        return Path(head).expanduser(), split
    return None


def load_split(directory: Path, split: str | None) -> DiskSplit:
    """The rows of `directory` (a Dataset) or of its `split` (a DatasetDict)."""
    try:
        import datasets
    except ImportError:
        raise DataFileError(f"data file {directory} is a Hugging Face datasets directory; reading "
                            f"it needs the datasets package: {PIP_INSTALL}") from None
    try:
        loaded = datasets.load_from_disk(str(directory))
    except Exception as exc:  # datasets raises several types for a damaged directory; all mean the same
        raise DataFileError(f"data file {directory} is not a readable datasets directory "
                            f"({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        table = _pick_split(directory, split, list(loaded.keys()), loaded)
        label = f"{directory}:{split}"
    else:
        if split is not None:
            raise DataFileError(f"data file {directory} holds one Dataset, not a DatasetDict with "
                                f"splits: name it without ':{split}'")
        table, label = loaded, str(directory)
    return DiskSplit(label, list(table.column_names), table.to_list())


def _pick_split(directory: Path, split: str | None, splits: list[str], loaded: Any) -> Any:
    names = ", ".join(splits) or "none"
    example = f"{directory}:{splits[0]}" if splits else f"{directory}:train"
    if split is None:
        raise DataFileError(f"data file {directory} is a DatasetDict with splits {names}: name "
                            f"one, e.g. {example}")
    if split not in splits:
        raise DataFileError(f"data file {directory} has no split '{split}'; its splits: {names} "
                            f"(e.g. {example})")
    return loaded[split]
