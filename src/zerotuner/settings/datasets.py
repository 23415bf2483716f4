"""Where the training data is: ZT_DATA_DIR, or several datasets listed in ZT_DATASETS_FILE.

A dataset is a local folder, an S3 prefix (`s3://bucket/prefix`, any S3-compatible store,
the credentials ZT_PUSH_TO uses) or a Hugging Face dataset (`hf://datasets/owner/name`,
optionally `@revision`). A remote one is fetched once per node into ZT_CACHE_DIR/datasets
(preflight/fetch.py) and then read as a local folder: `local_folder` says where, the same
answer on every rank. The datasets file (YAML, JSON or TOML, mounted like the config file):

    datasets:
      - path: /data/portraits
        repeats: 3                    # each image 3 times an epoch
        caption_template: "sks {caption}"
      - path: s3://my-bucket/styles/
        resolution: 768               # this dataset's buckets
      - path: hf://datasets/owner/name
        caption_column: prompt        # parquet shards: which column holds the caption
        control_column: input_image   # ... and an edit model's control image (or a list)
      - path: /data/edits
        control_dir: /data/edit-inputs  # an edit model's control images, named as the targets
      - path: /data/long-clips
        video_windows: uniform:4      # a video family: 4 windows spread over each clip

Fields left out take the job's settings (ZT_CAPTION_TEMPLATE, ZT_RESOLUTION, ZT_VIDEO_WINDOWS).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from zerotuner.errors import ConfigError
from zerotuner.settings.files import load_mapping, short_repr
from zerotuner.settings.schema import MAX_RESOLUTION, MIN_RESOLUTION, Settings, env_name
from zerotuner.settings.urls import hide_credentials, refuse_credentials
from zerotuner.settings.video_windows import Windows, parse_windows

FILE_SETTING = env_name("datasets_file")
DIR_SETTING = env_name("data_dir")
EVAL_DIR_SETTING = env_name("eval_data_dir")
REMOTE_FOLDER = "datasets"  # under ZT_CACHE_DIR: the fetched copies
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")
_HF = re.compile(
    r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*?)/?(?:@(?P<rev>[\w.\-/]+))?$"
)
IMAGE_LIKE = {".png", ".jpg", ".jpeg", ".webp", ".parquet"}
# Each epoch's order lists every image once per repeat, on every rank: an entry's repeats and
# all entries' together stay under this (20 entries x 10,000 took 2.1 GB and 106 s a step).
MAX_REPEATS = 10_000


@dataclass(frozen=True)
class Location:
    """Where one dataset's files are: `local` (a folder), `s3` (bucket + key prefix ending in
    / or empty) or `hf` (a dataset repo and its revision, None = main)."""

    kind: Literal["local", "s3", "hf"]
    where: str  # folder, bucket or repo
    prefix: str = ""  # S3 key prefix
    revision: str | None = None

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    @property
    def url(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.where}/{self.prefix}"
        if self.kind == "hf":
            return f"hf://datasets/{self.where}" + (f"@{self.revision}" if self.revision else "")
        return self.where


def parse_location(text: str, *, setting: str = DIR_SETTING) -> Location:
    """A dataset path as written; one line naming `setting` when it is a URL of no known kind
    or one carrying credentials (they go where secrets go, and the line masks them)."""
    refuse_credentials(text, setting)
    if match := _S3.match(text):
        prefix = (match["prefix"] or "").strip("/")
        return Location("s3", match["bucket"], f"{prefix}/" if prefix else "")
    if match := _HF.match(text):
        return Location("hf", match["repo"], revision=match["rev"])
    if "://" in text:
        raise ConfigError(
            f"{setting}={text!r}: not a dataset location; use a folder, s3://bucket/prefix or "
            "hf://datasets/owner/name (a Hugging Face dataset repo, optionally @revision)"
        )
    return Location("local", text)


class DatasetSource(BaseModel):
    """One entry of the datasets file (or ZT_DATA_DIR alone)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    repeats: int = Field(1, ge=1, le=MAX_REPEATS)
    caption_template: str | None = None
    resolution: int | None = Field(None, ge=MIN_RESOLUTION, le=MAX_RESOLUTION)  # as ZT_RESOLUTION
    caption_extension: str = ".txt"
    image_column: str | None = None  # parquet shards: defaults to the first image column
    caption_column: str | None = None  # parquet shards: `text`, `caption` or `prompt`
    # parquet shards: an edit model's control image column(s), in order; default the columns
    # named as metadata.jsonl's, `control`, `control_1`, ... (data/controls.py)
    control_column: str | list[str] | None = None
    # A local folder of control images (an edit family's inputs) named as their targets
    # (data/controls.py); refused in one line for a family that takes none or a missing folder.
    control_dir: str | None = Field(None, min_length=1)
    video_windows: str | None = None  # a video family's windows per clip: ZT_VIDEO_WINDOWS's

    @field_validator("video_windows")
    @classmethod
    def _windows(cls, value: str | None) -> str | None:
        return None if value is None else str(parse_windows(value))

    @property
    def control_columns(self) -> list[str] | None:
        """`control_column` as a list; None: the shards' `control`, `control_1`, ... columns."""
        named = self.control_column
        return [named] if isinstance(named, str) else named

    @property
    def windows(self) -> Windows | None:
        """`video_windows` parsed (validated when the file was read); None: the job's."""
        return None if self.video_windows is None else parse_windows(self.video_windows)

    @field_validator("path")
    @classmethod
    def _location(cls, value: str) -> str:
        try:
            parse_location(value, setting="path")
        except ConfigError as error:  # pydantic reports a ValueError with the entry's place
            raise ValueError(str(error).split(": ", 1)[1]) from None
        return value

    @field_validator("caption_template")
    @classmethod
    def _one_slot(cls, value: str | None) -> str | None:
        if value is not None and value.count("{caption}") != 1:
            raise ValueError("needs {caption} exactly once, e.g. `sks {caption}`")
        return value

    @field_validator("caption_extension")
    @classmethod
    def _extension(cls, value: str) -> str:
        if not re.fullmatch(r"\.[A-Za-z0-9_]{1,16}", value) or value.lower() in IMAGE_LIKE:
            raise ValueError("a file suffix such as .txt or .caption (not an image suffix)")
        return value

    @property
    def location(self) -> Location:
        return parse_location(self.path)


def sources(settings: Settings) -> list[DatasetSource]:
    """The run's datasets: ZT_DATASETS_FILE's entries, else ZT_DATA_DIR as one dataset that
    takes the job's caption template. Bad entries are one line each (exit 2)."""
    if settings.datasets_file is None:
        parse_location(settings.data_dir)
        return [DatasetSource(path=settings.data_dir, caption_template=settings.caption_template)]
    path = settings.datasets_file
    where = f"{FILE_SETTING}={path}"
    content = load_mapping(path, setting=FILE_SETTING)
    entries = content.get("datasets")
    extra = sorted(set(content) - {"datasets"})
    if extra or not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{where}: expected `datasets:` with a list of entries (path, repeats, "
            "caption_template, resolution, caption_extension, image_column, caption_column, "
            "control_column, control_dir, video_windows)"
            + (f"; unknown key {extra[0]!r}" if extra else "")
        )
    found, problems = [], []
    for number, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"path": entry}
        try:
            source = DatasetSource.model_validate(entry)
        except ValidationError as error:
            for e in error.errors():
                field = ".".join(str(p) for p in e["loc"]) or "entry"
                value = e["input"]  # masked before it is cut short: the cut may drop the `@`
                value = hide_credentials(value) if isinstance(value, str) else value
                got = f" (got {short_repr(value)})" if e["loc"] else ""
                problems.append(f"{where}: datasets[{number}].{field}: {_message(e)}{got}")
            continue
        if source.caption_template is None and settings.caption_template:
            source = source.model_copy(update={"caption_template": settings.caption_template})
        found.append(source)
    if problems:
        raise ConfigError(problems[0], problems=problems)
    if (total := sum(source.repeats for source in found)) > MAX_REPEATS:
        raise ConfigError(
            f"{where}: the entries' repeats add up to {total}; at most {MAX_REPEATS} in all "
            "(an epoch lists each image once per repeat): lower them, keeping their ratios"
        )
    return found


def eval_sources(settings: Settings) -> list[DatasetSource]:
    """ZT_EVAL_DATA_DIR as a dataset (the job's caption template), else none: the held-out
    images, read as ZT_DATA_DIR's (fetched likewise when remote)."""
    if settings.eval_data_dir is None:
        return []
    parse_location(settings.eval_data_dir, setting=EVAL_DIR_SETTING)
    return [DatasetSource(path=settings.eval_data_dir, caption_template=settings.caption_template)]


def _message(error: ErrorDetails) -> str:
    text = str(error["msg"])
    return text.removeprefix("Value error, ")


def local_folder(source: DatasetSource, cache_dir: Path) -> Path:
    """The folder a dataset is read from: a local one as given; a remote one's copy under
    ZT_CACHE_DIR/datasets, named by its URL (a readable part and a digest, so two prefixes
    never share a folder)."""
    location = source.location
    if not location.remote:
        return Path(location.where).expanduser()
    digest = hashlib.sha256(location.url.encode()).hexdigest()[:12]
    readable = re.sub(r"[^\w.\-]+", "-", f"{location.where}-{location.prefix}").strip("-.")
    return cache_dir / REMOTE_FOLDER / location.kind / f"{readable[:80]}-{digest}"
