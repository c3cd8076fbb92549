"""Typed config machinery: each component owns a `Config` subclass; this package loads YAML plus
`a.b.c=value` overrides into them and turns validation failures into one-line messages that name
the full key, the bad value and the fix."""

from polyrl.config.base import Config, ConfigError, describe, load_config, parse_overrides, to_yaml

__all__ = ["Config", "ConfigError", "describe", "load_config", "parse_overrides", "to_yaml"]
