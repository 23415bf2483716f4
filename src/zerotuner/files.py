"""Reading user files (YAML, JSON, TOML) with errors that give line and column."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml

from zerotuner.errors import ConfigError


def parse_json(text: str, *, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None


def parse_yaml(text: str, *, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: invalid YAML{where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    except (ValueError, TypeError, AttributeError):  # a tag or date PyYAML cannot construct
        # (its message would quote the value, which may be a secret)
        raise ConfigError(
            f"{source}: invalid YAML: a tagged or date value cannot be read (e.g. `!!int x`, "
            "2020-13-01); quote it to make it text"
        ) from None


def parse_toml(text: str, *, source: str) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # The message already ends with "(at line L, column C)".
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None


def read_text(path: Path, *, setting: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{setting}={path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{setting}={path}: is a directory, expected a file") from None
    except PermissionError:
        raise ConfigError(f"{setting}={path}: permission denied") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{setting}={path}: not a UTF-8 text file") from None


def load_mapping(path: Path, *, setting: str) -> dict[str, Any]:
    """A YAML, JSON or TOML file holding a mapping (chosen by suffix; YAML otherwise)."""
    text = read_text(path, setting=setting)
    source = f"{setting}={path}"
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = parse_json(text, source=source)
    elif suffix == ".toml":
        data = parse_toml(text, source=source)
    else:
        data = parse_yaml(text, source=source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    return data
