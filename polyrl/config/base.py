"""Config base class, YAML + dotted-override loading, and readable validation errors.

Each component declares its config as a `Config` subclass with a docstring under every field
(pydantic reads them as field descriptions, so `polyrl train --help-config` can list them).
Unknown keys are errors with a did-you-mean suggestion; choices and ranges are validated at start.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

C = TypeVar("C", bound="Config")


class Config(BaseModel):
    """Base of every component config: unknown keys forbidden, field docstrings kept."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        protected_namespaces=(),
        coerce_numbers_to_str=True,
    )


class ConfigError(ValueError):
    """A config that cannot run. `problems` holds one readable line per bad key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn ["a.b=1", "c=x"] into a nested dict; values are parsed as YAML scalars/lists."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override '{item}' must look like key.sub=value"])
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError([f"override '{item}': empty key part in '{key}'"])
        value = _override_value(item, raw)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override '{item}': '{part}' is already set to a value"])
            node = child
        node[parts[-1]] = value
    return nested


def _override_value(item: str, raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):  # [reasoning_gym:t?size=8]: YAML reads "?" as a key
            return [part.strip() for part in text[1:-1].split(",") if part.strip()]
        raise ConfigError([f"override '{item}': the value is not valid YAML; quote it "
                           "(key='\"value\"')"]) from None


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path} is not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path} must hold a mapping at the top level"])
    return data


def load_config(
    cls: type[C],
    files: Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    base: dict[str, Any] | None = None,
) -> C:
    """Build `cls` from defaults <- YAML files (in order) <- dotted overrides."""
    data: dict[str, Any] = dict(base or {})
    for f in files:
        data = deep_merge(data, read_yaml(f))
    data = deep_merge(data, parse_overrides(overrides))
    return validate(cls, data)


def validate(cls: type[C], data: dict[str, Any]) -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([format_error(cls, err) for err in exc.errors()]) from None


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


# --- error formatting --------------------------------------------------------------------------


def config_keys(cls: type[BaseModel]) -> dict[str, Any]:
    """The keys a user writes for `cls`'s fields: the alias where one is set (`async` for the
    field `async_`, a Python keyword), else the field name."""
    return {field.alias or name: field for name, field in cls.model_fields.items()}


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The config class that owns the key at `loc` (None if the path leaves the schema)."""
    current: Any = cls
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = config_keys(current).get(str(part)) or current.model_fields.get(str(part))
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """Optional[Model] / Model | None -> Model."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return annotation


def _choices(err: dict) -> str | None:
    expected = (err.get("ctx") or {}).get("expected")
    if not expected:
        return None
    # pydantic says: "'native', 'vllm' or 'sglang'"
    return ", ".join(part.strip().strip("'") for part in expected.replace(" or ", ", ").split(","))


def format_error(cls: type[BaseModel], err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ".".join(str(p) for p in loc) or "<root>"
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(cls, loc[:-1])
        valid = list(config_keys(owner)) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"; did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?" if close else ""
        listing = f" (valid keys: {', '.join(valid)})" if valid and not close else ""
        return f"{key}: unknown key{hint}{listing}"
    if kind in ("literal_error", "enum"):
        return f"{key}: {value!r} is not one of {_choices(err)}"
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        return f"{key}: {msg}" if loc else msg
    if kind == "missing":
        return f"{key}: required but not set"
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    msg = err["msg"]
    return f"{key}: {shown} is invalid: {msg[:1].lower()}{msg[1:]}"


def describe(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every leaf field, for `--help-config`."""
    rows = []
    for name, field in config_keys(cls).items():
        key = f"{prefix}{name}"
        ann = _unwrap(field.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe(ann, key + "."))
        else:
            type_name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
            default = None if field.is_required() else field.get_default(call_default_factory=True)
            rows.append((key, type_name, default, field.description or ""))
    return rows
