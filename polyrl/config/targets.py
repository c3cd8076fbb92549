"""The form of a plugin named in a config: "package.module:name" or "/path/to/file.py:name".

Pure string checks, so config modules (leaves) can validate the form of a plugin key without
importing anything; `polyrl.registry` imports the named object when it is first used
(docs/plugins.md).
"""

from __future__ import annotations

IMPORT_PATH_FORMS = "package.module:name or /path/to/file.py:name"
"""How the error messages spell the accepted forms."""


def is_file_target(target: str) -> bool:
    """"/path/to/file.py" (a user's file) rather than "package.module"."""
    return target.endswith(".py") or "/" in target or "\\" in target


def split_import_path(spec: str) -> tuple[str, str]:
    """("package.module" or "/path/to/file.py", "name"); ("", "") when `spec` is not of that form.
    rpartition: a Windows path may hold "C:"."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        return "", ""
    if not is_file_target(target) and not all(part.isidentifier() for part in target.split(".")):
        return "", ""
    return target, name


def is_import_path(spec: str) -> bool:
    """Whether `spec` names an object by import path rather than a registered name."""
    return bool(split_import_path(spec)[0])
