"""Remote datasets fetched once per node, before the ranks start, into ZT_CACHE_DIR/datasets.

`zerotuner train` runs on every node before torchrun; it fetches each `s3://` and
`hf://datasets/` dataset of the run (settings/datasets.py) into the folder
`settings.datasets.local_folder` names, and the ranks then read it as a local folder
(`data.scan.scan_sources` refuses one without its FETCHED marker). A lock on the folder lets
nodes that share a cache volume take turns; the second finds the work done.

- S3: every object under the prefix (any S3-compatible store; the credentials ZT_PUSH_TO
  uses). Each file is written beside its place and renamed when whole, its size checked and
  its MD5 against the ETag (single-part uploads; a multipart ETag is no MD5, the size is
  checked); a manifest of (size, ETag) per key lets an interrupted fetch go on where it
  stopped and a new start fetch only what changed. Files the prefix no longer holds are
  removed from the copy (the copy is ours: the bucket keeps the data).
- Hugging Face: `huggingface_hub.snapshot_download` (resumable, verified, into the same hub
  cache the model uses; HF_HUB_OFFLINE reads it without a network). Parquet shards (the hub's
  own layout: an image column of {bytes, path} and a caption column) are written out as
  image files with a metadata.jsonl per shard, shard by shard, each marked when done; a
  dataset of plain files (images + captions) is linked or copied as it is.
Every remote name (S3 key, hub file path) becomes a path inside the dataset's folder or is not
written: `_writable` skips, and `describe` lists, a name that is absolute, has an empty, `.`
or `..` part, or is a file where another name needs a folder; a parquet row's `path` only hints
at a suffix. A parquet shard's columns are checked, every shard's, before anything is written.
`check` lists instead (`listing_only`): counts and sizes, what the cache holds already.

ZT_LORA_FROM's remote adapter file (`fetch_adapter`) comes the same ways, one file: from S3 into
ZT_CACHE_DIR/adapters (weights.lora_from.Remote.copy_path; its key must be a name `_writable`
writes, checked against the listing's size and ETag, fetched again only when they change), from
the hub into the hub cache (`hf_hub_download`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from zerotuner.data.files import IMAGE_SUFFIXES
from zerotuner.data.scan import FETCHED
from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.families import hub_cache_dir
from zerotuner.publish.remote import RemoteError, S3Store, open_store
from zerotuner.settings.datasets import FILE_SETTING, DatasetSource, Location, local_folder
from zerotuner.settings.files import short_repr
from zerotuner.settings.schema import Settings, env_name
from zerotuner.weights import lora_from

log = logging.getLogger(__name__)

MANIFEST = ".zerotuner-manifest.json"
LOCK = ".zerotuner-fetch.lock"
LOG_EVERY_SECONDS = 30.0
CAPTION_COLUMNS = ("text", "caption", "prompt", "captions")
ROWS_PER_READ = 64  # parquet rows decoded at a time: bounded memory for any shard size
# File signatures of the image formats a shard's bytes may hold (its `path` may be absent).
SIGNATURES = ((b"\x89PNG", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"RIFF", ".webp"))
MAX_NAME_BYTES = 255 - len("..part")  # a name part, with room for its `.NAME.part` download
SKIPPED_SHOWN = 5  # names a line lists before "and N more" (a bucket may hold thousands)


@dataclass
class Fetched:
    """One remote dataset: what the remote holds and what the copy holds."""

    source: DatasetSource
    folder: Path
    files: int = 0
    bytes: int = 0
    complete: bool = False
    fetched_files: int = 0  # downloaded (or written out) by this call
    skipped: list[tuple[str, str]] = field(default_factory=list)  # remote names not written

    def describe(self) -> str:
        state = "fetched" if self.complete else "not fetched yet (train fetches it)"
        line = f"{self.source.path}: {self.files} files, {_size(self.bytes)}, {state}"
        return f"{line}, {_not_written(self.skipped)}" if self.skipped else line


@dataclass
class RemoteData:
    sources: list[Fetched] = field(default_factory=list)

    @property
    def missing(self) -> list[Fetched]:
        return [f for f in self.sources if not f.complete]

    def describe(self) -> str:
        held = sum(f.bytes for f in self.sources if f.complete)
        lines = "; ".join(f.describe() for f in self.sources)
        return f"{lines}; {_size(held)} of fetched copies in ZT_CACHE_DIR/datasets"


def fetch_all(
    sources: list[DatasetSource], settings: Settings, *, listing_only: bool = False
) -> RemoteData:
    """Fetch (or, `listing_only`, list) every remote dataset; local ones are left alone.
    Network and permission failures are EnvironmentUnfit (exit 3) with one line."""
    found = RemoteData()
    for source in sources:
        location = source.location
        if not location.remote:
            continue
        folder = local_folder(source, settings.cache_dir)
        fetch = _fetch_s3 if location.kind == "s3" else _fetch_hub
        try:
            found.sources.append(fetch(source, location, folder, settings, listing_only))
        except RemoteError as error:
            raise EnvironmentUnfit(f"{source.path}: cannot fetch it: {error}") from None
    return found


def fetch_adapter(settings: Settings, *, offline: bool = False) -> Path | None:
    """ZT_LORA_FROM's file into the cache when it is an `s3://` or `hf://` URL (its path; None
    for a local file or no adapter). A bad URL, a missing object or file, a repo this token
    cannot read: one line, exit 2; an unreachable store or a refused S3 request: exit 3 (as a
    remote dataset's). `offline`: the hub cache only (HF_HUB_OFFLINE)."""
    if settings.training_type != "lora" or not settings.lora_from:
        return None
    found = lora_from.remote(settings.lora_from)
    if found is None:
        return None
    where = f"{lora_from.NAME}={found.url}"
    names, skipped = _writable([found.key])
    if not names:  # the key could not be a file of the cache (absolute, `..`, a folder, ...)
        why = skipped[0][1] if skipped else "a folder or hidden name"
        raise ConfigError(f"{where}: the key is {why}, not a file name the cache can hold")
    if found.kind == "hf":
        return _fetch_hub_file(found, where, settings, offline)
    try:
        return _fetch_s3_file(found, where, settings)
    except RemoteError as error:
        if "NoSuchBucket" in str(error):
            raise ConfigError(f"{where}: no such bucket; check the URL") from None
        raise EnvironmentUnfit(f"{where}: cannot fetch it: {error}") from None


def _fetch_s3_file(found: lora_from.Remote, where: str, settings: Settings) -> Path:
    folder, name = found.key.rpartition("/")[::2]
    store = open_store(f"s3://{found.where}/{folder}", hf_token=None,
                       secrets_dir=settings.secrets_dir)  # fmt: skip
    assert isinstance(store, S3Store)  # an s3:// location
    listed = store.objects(name).get(name)  # the keys that begin with it: this one exactly
    if listed is None:
        raise ConfigError(f"{where}: no such object in the bucket; check the URL")
    size, etag = listed
    path = found.copy_path(settings.cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        marker = path.parent / FETCHED
        if _read_json(marker) == [size, etag] and path.is_file() and path.stat().st_size == size:
            return path  # fetched before, unchanged
        marker.unlink(missing_ok=True)
        part = path.with_name(f".{name}.part")
        store.download(name, part)
        _verify(part, found.key, size, etag)
        os.replace(part, path)
        _write_json(marker, [size, etag])
    log.info("%s: fetched, %s, into %s", where, _size(size), path)
    return path


def _fetch_hub_file(found: lora_from.Remote, where: str, settings: Settings, offline: bool) -> Path:
    from huggingface_hub import hf_hub_download

    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    readable = "not a file of a repository (or revision) this token can read"
    with _hub_errors(where, readable, hint=f"; check the URL and {env_name('hf_token')}"):
        path = hf_hub_download(
            found.where, found.key, revision=found.revision, token=token,
            repo_type="dataset" if found.dataset else None, local_files_only=offline,
            cache_dir=hub_cache_dir(settings.cache_dir),
        )  # fmt: skip
    log.info("%s: in the hub cache at %s", where, path)
    return Path(path)


@contextmanager
def _hub_errors(
    where: str, refused: str, *, hint: str = "", name_error: bool = True
) -> Iterator[None]:
    """The hub's errors as zerotuner's one line: a repository, revision or file this token
    cannot read is ConfigError (`where: refused`); not cached while offline or unreachable,
    or any other failure to fetch, EnvironmentUnfit."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError:  # before EntryNotFoundError, its base
        raise EnvironmentUnfit(
            f"{where}: not in the hub cache and the hub is unreachable or HF_HUB_OFFLINE is set"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, HFValidationError,
            EntryNotFoundError) as error:  # fmt: skip
        named = f" ({type(error).__name__})" if name_error else ""
        raise ConfigError(f"{where}: {refused}{named}{hint}") from None
    except OSError as error:  # the hub answered with an error, or not at all
        raise EnvironmentUnfit(f"{where}: cannot fetch it ({type(error).__name__})") from None


# --- S3 -------------------------------------------------------------------------------------


def _fetch_s3(
    source: DatasetSource, location: Location, folder: Path, settings: Settings, listing: bool
) -> Fetched:
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    store = open_store(location.url, hf_token=token, secrets_dir=settings.secrets_dir)
    assert isinstance(store, S3Store)  # an s3:// location
    listed = store.objects("")
    names, skipped = _writable(listed)
    objects = {k: listed[k] for k in names}
    total = sum(size for size, _ in objects.values())
    state = Fetched(source, folder, len(objects), total, skipped=skipped)
    if not objects:
        written = f" to write ({_not_written(skipped)})" if skipped else ""
        raise ConfigError(f"{source.path}: no objects under this prefix{written}; check the URL")
    if listing:
        state.complete = _manifest(folder) == _expected(objects) and (folder / FETCHED).is_file()
        return state
    _log_skipped(state)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        manifest = {k: v for k, v in _manifest(folder).items() if k in objects}
        (folder / FETCHED).unlink(missing_ok=True)
        _prune(folder, set(objects))  # first: a key may now need a file's name as a folder
        todo = [k for k in sorted(objects) if not _have(folder, k, objects[k], manifest)]
        progress = _Progress(f"fetching {source.path}", len(todo))
        for key in todo:
            size, etag = objects[key]
            path = folder / key
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f".{path.name}.part")
            store.download(key, part)
            _verify(part, key, size, etag)
            os.replace(part, path)
            manifest[key] = [size, etag]
            _write_json(folder / MANIFEST, manifest)  # an interruption keeps what is done
            state.fetched_files += 1
            progress.advance(size)
        _write_json(folder / MANIFEST, _expected(objects))
        _write_json(folder / FETCHED, {"url": location.url, "files": len(objects)})
    state.complete = True
    progress.done()
    return state


def _writable(names: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The remote names the copy may hold, sorted, and the others with why each is not written.
    A name is written as `folder / name`, so it must be relative with plain parts: S3 allows
    `/tmp/x` and `data//tmp/x` (absolute after the prefix), which would be written anywhere.
    Folder markers (`a/`) and hidden names (`.gitattributes`) are no files of the dataset and
    are left out without a word."""
    kept, skipped = [], []
    for name in sorted(names):
        if name.endswith("/"):
            continue
        parts = name.split("/")
        if name.startswith("/"):
            skipped.append((name, "an absolute name"))
        elif "" in parts:
            skipped.append((name, "an empty part (//)"))
        elif any(p in (".", "..") for p in parts):
            skipped.append((name, "a . or .. part"))
        elif any(len(os.fsencode(p)) > MAX_NAME_BYTES for p in parts):
            skipped.append((name, f"a part over {MAX_NAME_BYTES} bytes"))
        elif any(c < " " or c == "\x7f" for c in name):
            skipped.append((name, "a control character"))
        elif not any(p.startswith(".") for p in parts):
            kept.append(name)
    # `x.png` and `x.png/y.png`: one path cannot be a file and a folder; the folder's files stay.
    folders = {parent for name in kept for parent in _parents(name)}
    skipped += [
        (name, "a file where other names need a folder") for name in kept if name in folders
    ]
    return [name for name in kept if name not in folders], skipped


def _parents(name: str) -> Iterator[str]:
    parts = name.split("/")
    for end in range(1, len(parts)):
        yield "/".join(parts[:end])


def _not_written(skipped: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{short_repr(n)} ({why})" for n, why in skipped[:SKIPPED_SHOWN])
    more = len(skipped) - SKIPPED_SHOWN
    return f"{len(skipped)} not written: {shown}" + (f" and {more} more" if more > 0 else "")


def _log_skipped(state: Fetched) -> None:
    if state.skipped:
        log.warning("%s: %s", state.source.path, _not_written(state.skipped))


def _expected(objects: dict[str, tuple[int, str]]) -> dict[str, list[int | str]]:
    return {k: [size, etag] for k, (size, etag) in objects.items()}


def _have(
    folder: Path, key: str, entry: tuple[int, str], manifest: dict[str, list[int | str]]
) -> bool:
    path = folder / key
    return manifest.get(key) == list(entry) and path.is_file() and path.stat().st_size == entry[0]


def _verify(path: Path, key: str, size: int, etag: str) -> None:
    got = path.stat().st_size
    if got != size:
        path.unlink(missing_ok=True)
        raise RemoteError(f"{key}: {got} bytes arrived, the listing says {size}")
    if len(etag) == 32 and "-" not in etag:  # a single-part upload's ETag is its MD5
        digest = hashlib.md5(usedforsecurity=False)
        with path.open("rb") as reader:
            while chunk := reader.read(2**20):
                digest.update(chunk)
        if digest.hexdigest() != etag:
            path.unlink(missing_ok=True)
            raise RemoteError(f"{key}: its MD5 differs from the ETag {etag}")


def _prune(folder: Path, keys: set[str]) -> None:
    """Remove files of the copy the remote no longer holds (ours, not the user's), then the
    folders that leaves empty (a key may be a file where a folder was)."""
    for path in sorted(folder.rglob("*"), reverse=True):  # a folder's files before the folder
        name = path.relative_to(folder).as_posix()
        if path.is_file() and not path.name.startswith(".zerotuner") and name not in keys:
            path.unlink()
        elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()


# --- Hugging Face datasets ------------------------------------------------------------------


def _fetch_hub(
    source: DatasetSource, location: Location, folder: Path, settings: Settings, listing: bool
) -> Fetched:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    readable = "not a dataset repository (or revision) this token can read"
    snapshot: Path | None = None
    with _hub_errors(source.path, readable, name_error=False):
        try:
            snapshot = Path(
                snapshot_download(
                    location.where,
                    repo_type="dataset",
                    revision=location.revision,
                    token=token,
                    cache_dir=hub_cache_dir(settings.cache_dir),
                    local_files_only=listing,
                )  # fmt: skip
            )
        except LocalEntryNotFoundError:
            if not listing:
                raise
            snapshot = None  # listed below, outside the mapping
    if snapshot is None:
        return _list_hub(source, location, folder, token)
    found = {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}
    names, skipped = _writable(found)
    files = [found[name] for name in names]
    size = sum(p.stat().st_size for p in files)
    state = Fetched(source, folder, len(files), size, skipped=skipped)
    # The columns are part of what the copy is: a changed `caption_column` writes it again
    # (`control_column` only where set: a copy made before it existed stays valid)
    columns: list[Any] = [source.image_column, source.caption_column]
    columns += [source.control_column] if source.control_column else []
    marker = {"url": location.url, "commit": snapshot.name, "columns": columns}
    if _read_json(folder / FETCHED) == marker:
        state.complete = True
        return state
    shards = {
        p: _shard_columns(p, snapshot, source, settings) for p in files if p.suffix == ".parquet"
    }
    if listing:
        return state
    _log_skipped(state)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        (folder / FETCHED).unlink(missing_ok=True)
        progress = _Progress(f"writing out {source.path}", len(shards) or len(files))
        if shards:
            for shard, columns in shards.items():
                state.fetched_files += _write_shard(shard, snapshot, folder, columns, marker)
                progress.advance(shard.stat().st_size)
        else:
            for name, path in zip(names, files, strict=True):
                _link_or_copy(path, folder / name)
                state.fetched_files += 1
                progress.advance(path.stat().st_size)
        _write_json(folder / FETCHED, marker)
    state.complete = True
    progress.done()
    return state


def _list_hub(
    source: DatasetSource, location: Location, folder: Path, token: str | None
) -> Fetched:
    """What `check` says of a hub dataset the cache does not hold yet: its files and size."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(token=token).dataset_info(
            location.where, revision=location.revision, files_metadata=True
        )
    except Exception as error:  # offline, unreachable, refused: check reports, train fetches
        raise EnvironmentUnfit(
            f"{source.path}: cannot list it ({type(error).__name__}); it is not in the hub "
            "cache either"
        ) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    names, skipped = _writable(siblings)
    size = sum(siblings[name].size or 0 for name in names)
    return Fetched(source, folder, len(names), size, skipped=skipped)


def _shard_columns(
    shard: Path, snapshot: Path, source: DatasetSource, settings: Settings
) -> list[str]:
    """A shard's image and caption columns, from its schema (the file's footer), or one line
    naming the entry, the shard and the column."""
    import pyarrow.parquet as pq

    name = shard.relative_to(snapshot).as_posix()
    try:
        schema = pq.read_schema(shard)
    except Exception as error:  # pyarrow raises its own kinds for a damaged file
        raise ConfigError(
            f"{source.path}: {name} is not a readable parquet file ({error})"
        ) from None
    entry = source.path
    if settings.datasets_file is not None:
        entry = f"{FILE_SETTING}={settings.datasets_file}: {entry}"
    return list(_columns(schema, source, f"{entry}: {name}"))


def _write_shard(
    shard: Path, snapshot: Path, folder: Path, columns: list[str], marker: dict[str, Any]
) -> int:
    """One parquet shard as image files and a metadata.jsonl in a folder of its own; skipped
    when a previous fetch of the same commit finished it. Returns the images written."""
    import pyarrow.parquet as pq

    out = folder / shard.relative_to(snapshot).with_suffix("")
    done = out / ".zerotuner-shard.json"
    if _read_json(done) == marker:
        return 0
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    reader = pq.ParquetFile(shard)
    written, number = 0, 0
    with (out / "metadata.jsonl").open("w") as metadata:
        for batch in reader.iter_batches(batch_size=ROWS_PER_READ, columns=columns):
            cells = zip(*(batch.column(c).to_pylist() for c in columns), strict=True)
            for image, caption, *controls in cells:
                number += 1
                data, name = _image_bytes(image)
                if data is None:
                    continue  # an empty cell: nothing to train on
                file_name = f"{number:07d}{_suffix(data, name)}"
                (out / file_name).write_bytes(data)
                text = "" if caption is None else str(caption)
                row: dict[str, Any] = {"file_name": file_name, "text": text}
                if controls:  # an empty control cell: the target is skipped with why (scan)
                    row["control"] = _write_controls(out, number, controls)
                metadata.write(json.dumps(row) + "\n")
                written += 1
    _write_json(done, marker)
    return written


def _write_controls(out: Path, number: int, cells: list[Any]) -> list[str]:
    """A row's control images beside its target, as metadata.jsonl's `control` names them:
    `0000007.control.png`, then `0000007.control_1.png`, ... (data/controls.py), in the
    columns' order, a list cell's images (the hub's `Sequence(Image)`) in its own order."""
    images = [image for cell in cells for image in (cell if isinstance(cell, list) else [cell])]
    names: list[str] = []
    for image in images:
        data, name = _image_bytes(image)
        if data is None:
            continue
        place = len(names)
        tag = "control" if place == 0 else f"control_{place}"
        file_name = f"{number:07d}.{tag}{_suffix(data, name)}"
        (out / file_name).write_bytes(data)
        names.append(file_name)
    return names


def _columns(schema: Any, source: DatasetSource, where: str) -> tuple[str, ...]:
    """The image column (the hub's Image feature: a struct with binary `bytes`; or binary),
    the caption column (text) and the control image columns (each of images or of lists of
    them), as the entry names them or as found; `where` begins an error line (the entry and
    the shard)."""
    import pyarrow as pa

    def binary(kind: Any) -> bool:
        return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)

    def is_image(kind: Any) -> bool:
        if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
            return binary(kind.field("bytes").type)
        return binary(kind)

    def is_images(kind: Any) -> bool:  # an image, or a list of them (Sequence(Image))
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        return is_image(kind.value_type if listed else kind)

    def is_text(kind: Any) -> bool:  # null: a column of empty captions
        return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)

    names = schema.names
    kinds = {name: schema.field(name).type for name in names}
    image = source.image_column or next((n for n in names if is_image(kinds[n])), None)
    named = [n for n in CAPTION_COLUMNS if n in names]  # a text one first, else say its type
    caption = source.caption_column or next((n for n in named if is_text(kinds[n])), None)
    caption = caption or next(iter(named), None)
    for what, name, setting, fits in (("image", image, "image_column", is_image),
                                      ("caption", caption, "caption_column", is_text)):  # fmt: skip
        if name is None or name not in names:
            raise ConfigError(
                f"{where} has no {what} column"
                + (f" {name!r}" if name else "")
                + f" (its columns: {', '.join(names)}); name it with `{setting}` in the "
                "datasets file"
            )
        if not fits(kinds[name]):
            fitting = [n for n in names if fits(kinds[n])]
            raise ConfigError(
                f"{where}: {setting}={name!r} is a column of {kinds[name]}, not of "
                + ("images (the hub's Image feature or bytes)" if what == "image" else "text")
                + f"; its {what} columns: {', '.join(fitting) or 'none'}"
            )
    assert image is not None and caption is not None  # refused above
    controls = source.control_columns
    if controls is None:  # metadata.jsonl's names: `control`, then `control_1`, ...
        controls = [n for n in ("control", *(f"control_{i}" for i in range(1, 10)))
                    if n in names and is_images(kinds[n])]  # fmt: skip
    for name in controls:
        if name not in names or not is_images(kinds[name]):
            fitting = [n for n in names if is_images(kinds[n]) and n != image]
            raise ConfigError(
                f"{where}: control_column={name!r} is "
                + (f"a column of {kinds[name]}" if name in names else "no column")
                + f", not of images; its image columns: {', '.join(fitting) or 'none'}"
            )
    return image, caption, *controls


def _image_bytes(cell: Any) -> tuple[bytes | None, str]:
    """A cell's bytes and its `path`, which only hints at a suffix (it names no file here)."""
    if isinstance(cell, dict):
        path = cell.get("path")
        return cell.get("bytes"), path if isinstance(path, str) else ""
    return cell, ""


def _suffix(data: bytes, name: str) -> str:
    """The file's suffix from its bytes (else its name's): scan reads PNG, JPEG and WebP and
    lists anything else among the skipped files."""
    for signature, suffix in SIGNATURES:
        if data.startswith(signature) and (suffix != ".webp" or data[8:12] == b"WEBP"):
            return suffix
    suffix = PurePosixPath(name).suffix.lower()
    return suffix if suffix in IMAGE_SUFFIXES else ".unknown"


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    real = source.resolve()  # the hub cache's snapshot files link into its blobs
    try:
        os.link(real, target)
    except OSError:
        shutil.copyfile(real, target)


# --- shared ---------------------------------------------------------------------------------


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One fetcher per folder at a time (nodes sharing a cache volume)."""
    with (folder / LOCK).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _manifest(folder: Path) -> dict[str, list[int | str]]:
    found = _read_json(folder / MANIFEST)
    return found if isinstance(found, dict) else {}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, content: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, path)


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count < 2**30 else f"{count / 2**30:.2f} GiB"


class _Progress:
    """A log line each tenth of the files (and at least every LOG_EVERY_SECONDS)."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done_count, self.bytes = what, total, 0, 0
        self.started = self.logged = time.monotonic()
        self.tenths = 0
        if total:
            log.info("%s: %d files to go", what, total)

    def advance(self, size: int) -> None:
        self.done_count, self.bytes = self.done_count + 1, self.bytes + size
        now = time.monotonic()
        tenths = self.done_count * 10 // max(self.total, 1)
        if tenths > self.tenths or now - self.logged > LOG_EVERY_SECONDS:
            self.tenths, self.logged = tenths, now
            log.info("%s: %d/%d files, %s", self.what, self.done_count, self.total,
                     _size(self.bytes))  # fmt: skip

    def done(self) -> None:
        if self.total:
            log.info("%s: done, %d files, %s in %.1f s", self.what, self.done_count,
                     _size(self.bytes), time.monotonic() - self.started)  # fmt: skip
