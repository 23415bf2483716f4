"""Documentation generated from the code, so it cannot drift from it: the settings (from the
settings model) and the metrics (from the metric catalog).

`settings_table_markdown()` is the reference table of docs/configuration.md (between the
settings markers below), `settings_table_markdown(KEY_SETTINGS)` the README's short table of the
settings most runs need (between the key-settings markers), and `example_env()` is
`config/example.env`: every setting, in declaration order, commented out with its description
and default; `metrics_table_markdown()` is docs/operations.md's metrics table (between the
metrics markers). `python -m zerotuner.docs --write` regenerates them all; `--check` exits 1 when
any is stale (the test suite runs the same comparison).
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo

from zerotuner.families import FAMILIES
from zerotuner.monitor.metrics import CATALOG
from zerotuner.settings.schema import Settings, env_name

TABLE_START = "<!-- settings:start -->"
TABLE_END = "<!-- settings:end -->"
KEY_START = "<!-- key-settings:start -->"
KEY_END = "<!-- key-settings:end -->"
SETTINGS_PAGE = Path("docs/configuration.md")  # the full table
README = Path("README.md")  # the short one
# The handful of settings most runs need: the README's table (in declaration order).
KEY_SETTINGS = (
    "model", "data_dir", "output_dir", "training_type", "resolution", "train_batch_size",
    "max_steps", "learning_rate", "zero_stage", "push_to", "hf_token",
)  # fmt: skip
EXAMPLE_ENV = Path("config/example.env")
METRICS_START = "<!-- metrics:start -->"
METRICS_END = "<!-- metrics:end -->"
METRICS_PAGE = Path("docs/operations.md")

_SIMPLE_TYPES = {
    str: "text",
    int: "integer",
    float: "number",
    bool: "true | false",
    Path: "path",
    SecretStr: "secret",
    dict: "JSON object",
}


def env_names(name: str, field: FieldInfo) -> list[str]:
    """Every environment variable that sets this field, the canonical `ZT_*` name first."""
    names = [env_name(name)]
    if isinstance(field.validation_alias, AliasChoices):
        for choice in field.validation_alias.choices:
            if isinstance(choice, str) and choice.upper() not in names:
                names.append(choice.upper())
    return names


def type_text(annotation: Any) -> str:
    """A reader's name for a type: `auto | 0 | 1 | 2 | 3`, `path`, `list of text`."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return type_text(get_args(annotation)[0])
    if origin is Literal:
        return " | ".join(_value_text(v) for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [type_text(a) for a in get_args(annotation) if a is not type(None)]
        return " | ".join(parts)
    if origin is list:
        (item,) = get_args(annotation) or (str,)
        return f"list of {type_text(item)}"
    if origin is dict:
        return "JSON object"
    return _SIMPLE_TYPES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds_text(field: FieldInfo) -> str:
    """Numeric limits declared on the field (`>= 1`, `64..4096`), or ''."""
    low: object = None
    high: object = None
    low_op = high_op = ""
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            low, low_op = item.ge, ">="
        elif isinstance(item, annotated_types.Gt):
            low, low_op = item.gt, ">"
        elif isinstance(item, annotated_types.Le):
            high, high_op = item.le, "<="
        elif isinstance(item, annotated_types.Lt):
            high, high_op = item.lt, "<"
    if low is not None and high is not None and low_op == ">=" and high_op == "<=":
        return f"{low}..{high}"
    parts = [f"{op} {v}" for op, v in ((low_op, low), (high_op, high)) if v is not None]
    return ", ".join(parts)


def default_value(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]  # ours take no data
    return field.default


def _value_text(value: Any) -> str:
    """A value as a user would write it in an environment variable."""
    if value is None or value == [] or value == {}:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def setting_type(name: str) -> Any:
    """A setting's type as the docs and the builder show it: ZT_MODEL_FAMILY's choices are the
    family registry's names, which the settings layer (below the families) cannot list."""
    if name == "model_family":
        return Literal[("auto", *FAMILIES)]
    return Settings.model_fields[name].annotation


def _rows() -> list[tuple[list[str], str, str, str]]:
    rows = []
    for name, field in Settings.model_fields.items():
        kind = type_text(setting_type(name))
        bounds = bounds_text(field)
        if bounds:
            kind = f"{kind} ({bounds})"
        rows.append((env_names(name, field), kind, _value_text(default_value(field)), name))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table_markdown(only: Collection[str] | None = None) -> str:
    """The reference table: one row per setting (or per setting in `only`), in declaration
    order."""
    lines = [
        "| Variable | Type | Default | Description |",
        "|---|---|---|---|",
    ]
    for names, kind, default, name in _rows():
        if only is not None and name not in only:
            continue
        shown_names = " / ".join(f"`{n}`" for n in names)
        shown_default = f"`{_cell(default)}`" if default else "*(empty)*"
        description = Settings.model_fields[name].description or ""
        lines.append(f"| {shown_names} | {_cell(kind)} | {shown_default} | {_cell(description)} |")
    return "\n".join(lines) + "\n"


def example_env() -> str:
    """`config/example.env`: every setting commented out, with its description and default."""
    out = [
        "# zerotuner settings: every ZT_* variable, commented out at its default.",
        "# Generated from src/zerotuner/settings/schema.py by `python -m zerotuner.docs --write`;",
        "# do not edit by hand. Uncomment a line to set it. Docker: `--env-file`; compose:",
        "# `env_file`. Environment variables override the config file (ZT_CONFIG_FILE).",
        "# Secrets (HF_TOKEN) belong in a secret file under /run/secrets, not in this file.",
    ]
    for names, kind, default, name in _rows():
        field = Settings.model_fields[name]
        out.append("")
        out.append(f"# {field.description or name}")
        out.append(f"# Type: {kind}. Default: {default or '(empty)'}")
        if len(names) > 1:
            out.append(f"# Also read from: {', '.join(names[1:])}.")
        shown = "" if field.annotation is SecretStr | None else default
        out.append(f"#{names[0]}={shown}")
    return "\n".join(out) + "\n"


def metrics_table_markdown() -> str:
    """One row per series of the metric catalog: name, type, labels, who makes it, what."""
    where = {"rank": "each rank", "node": "the node", "push": "the pusher (ZT_PUSH_TO)"}
    rows = ["| metric | type | labels | made by | what |", "|---|---|---|---|---|"]
    for spec in CATALOG:
        labels = ("rank", "gpu_uuid (CUDA)") if spec.device else spec.labels
        kind = spec.kind + (" (CUDA only)" if spec.cuda_only else "")
        name = f"`{spec.name}`" + (" *" if spec.contract else "")
        cells = [name, kind, ", ".join(labels) or "-", where[spec.where], _cell(spec.help)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def replace_between_markers(
    text: str, body: str, markers: tuple[str, str] = (TABLE_START, TABLE_END), where: str = "text"
) -> str:
    """Swap what lies between the markers; ValueError when they are missing."""
    first, last = markers
    start = text.find(first)
    end = text.find(last)
    if start < 0 or end < start:
        raise ValueError(f"{where} lacks the markers {first} ... {last}")
    head = text[: start + len(first)]
    return f"{head}\n{body}{text[end:]}"


def generated_files(root: Path) -> dict[Path, str]:
    """Each generated file under `root` with the content it should have."""
    page = (root / SETTINGS_PAGE).read_text(encoding="utf-8")
    readme = (root / README).read_text(encoding="utf-8")
    operations = (root / METRICS_PAGE).read_text(encoding="utf-8")
    return {
        root / SETTINGS_PAGE: replace_between_markers(
            page, settings_table_markdown(), where=str(SETTINGS_PAGE)
        ),
        root / README: replace_between_markers(
            readme, settings_table_markdown(KEY_SETTINGS), (KEY_START, KEY_END), str(README)
        ),
        root / EXAMPLE_ENV: example_env(),
        root / METRICS_PAGE: replace_between_markers(
            operations, metrics_table_markdown(), (METRICS_START, METRICS_END), str(METRICS_PAGE)
        ),
    }


def stale_files(root: Path) -> list[Path]:
    """Generated files whose content differs from what the settings model produces."""
    return [
        path
        for path, want in generated_files(root).items()
        if not path.exists() or path.read_text(encoding="utf-8") != want
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerotuner.docs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables and example.env")
    mode.add_argument("--check", action="store_true", help="exit 1 when any is stale")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in generated_files(args.root).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = stale_files(args.root)
        for path in stale:
            print(f"stale: {path} (run `python -m zerotuner.docs --write`)", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(settings_table_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
