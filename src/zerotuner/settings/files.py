"""Reading user files (YAML, JSON, TOML) with errors that give line and column.

Every file and inline text a user gives as configuration comes through here, so the limits
that keep a careless or hostile input from hanging or exhausting the process hold once for
all of them (config file, DeepSpeed JSON, accelerate YAML, the builder's files):
- only regular files, at most MAX_FILE_BYTES (a FIFO or /dev/zero would block or never end);
- at most MAX_VALUES values once YAML aliases are expanded (an alias bomb is kilobytes that
  expand to billions), nested at most MAX_DEPTH deep;
- no duplicate keys (the last would win silently), no NaN or infinity, no integer beyond
  64 bits (DeepSpeed and torch take none of them; float() of one overflows).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

import yaml

from zerotuner.errors import ConfigError

MAX_FILE_BYTES = 4 * 2**20  # a config file is a few KiB; this bounds what a mistake costs
MAX_VALUES = 100_000  # scalars + lists + mappings, aliases expanded
MAX_DEPTH = 64  # real configs nest 4-5 deep; bounds every recursive walk after this one
MAX_INT = 2**63 - 1


def parse_json(text: str, *, source: str) -> Any:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{source}: duplicate key {key!r}; give each key once")
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError:  # an integer of more than 4300 digits (Python's int() limit)
        raise ConfigError(f"{source}: a number too long to read") from None
    check_values(data, source=source)
    return data


class _Loader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys and measures the document before building it."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # A mis-tagged scalar (`!!map x`) arrives here too: SafeConstructor refuses it below.
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then overrides
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, list | dict):
                    continue  # unhashable: SafeConstructor reports it
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}; give each key once",
                        key_node.start_mark,
                    )  # fmt: skip
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root: yaml.Node) -> None:
    """Count the values the document holds with every alias expanded, without expanding:
    an alias is the same node object as its anchor, so each node's count is computed once."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if id(node) in sizes:
            continue
        if depth > MAX_DEPTH:
            raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        children = (
            [c for pair in node.value for c in pair]
            if isinstance(node, yaml.MappingNode)
            else list(node.value)
        )
        pending = [c for c in children if id(c) not in sizes]
        if pending:
            stack.append((node, depth))
            stack.extend((c, depth + 1) for c in pending)
            continue
        sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
        if sizes[id(node)] > MAX_VALUES:
            raise yaml.YAMLError(
                f"it expands to more than {MAX_VALUES} values (YAML aliases repeating anchors?)"
            )


def parse_yaml(text: str, *, source: str) -> Any:
    try:
        loader = _Loader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: invalid YAML{where}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, TypeError, AttributeError):  # a tag or date PyYAML cannot construct
        # (its message would quote the value, which may be a secret)
        raise ConfigError(
            f"{source}: invalid YAML: a tagged, date or overlong number value cannot be read "
            "(e.g. `!!int x`, 2020-13-01); quote it to make it text"
        ) from None
    check_values(data, source=source)
    return data


def parse_toml(text: str, *, source: str) -> Any:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # The message already ends with "(at line L, column C)".
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError:  # an integer of more than 4300 digits
        raise ConfigError(f"{source}: invalid TOML: a number too long to read") from None
    check_values(data, source=source)
    return data


def check_values(data: Any, *, source: str) -> None:
    """Refuse NaN, infinities, integers beyond 64 bits and nesting deeper than MAX_DEPTH
    anywhere in parsed data, naming the key path (`zero_optimization.stage`)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep")
        where = f"{source}: {path or 'the value'}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}={value}: expected a finite number (no NaN or infinity)")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ConfigError(f"{where}: a number beyond 2**63: expected a smaller one")
        # Pushed in reverse: the first problem in document order is the one named.
        if isinstance(value, dict):
            items = [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            stack.extend((v, p, depth + 1) for v, p in reversed(items))
        elif isinstance(value, list):
            items = [(v, f"{path}[{i}]") for i, v in enumerate(value)]
            stack.extend((v, p, depth + 1) for v, p in reversed(items))


def short_repr(value: object, limit: int = 80) -> str:
    """A value as an error line shows it: a megabyte of input is not one line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 24]}... ({len(text)} characters)"


def _not_regular(mode: int) -> str | None:
    for test, what in (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):  # fmt: skip
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"


def read_text(path: Path, *, setting: str) -> str:
    """A user's file as text: a regular file of at most MAX_FILE_BYTES, else one line naming
    `setting`. Never blocks: a FIFO or device is refused before it is opened, and opened
    without blocking in case one replaced the file since."""
    where = f"{setting}={path}"
    if "\x00" in str(path):
        raise ConfigError(f"{setting}: the path contains a NUL byte")
    try:
        what = _not_regular(os.stat(path).st_mode)
        if what is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                what = _not_regular(os.fstat(f.fileno()).st_mode)
                data = b"" if what else f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except PermissionError:
        raise ConfigError(f"{where}: permission denied") from None
    except OSError as exc:  # a name too long, a symlink loop, an I/O error
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if what:
        raise ConfigError(f"{where}: is {what}, expected a regular file")
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{where}: larger than {MAX_FILE_BYTES // 2**20} MiB; expected a config file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a UTF-8 text file") from None


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
