"""Captions: where each picture's comes from, how long it may be, and when it is dropped.

A caption is read from the sidecar beside its picture (`foo.txt`, or a dataset's
`caption_extension`), else from a metadata.jsonl (Hugging Face imagefolder layout, whose rows
may name control images too), else made of the file name; then it goes through
ZT_CAPTION_TEMPLATE (`apply_template`). Tokenizers keep a few KiB of text at most, so a caption
is read up to CAPTION_BYTES. Which samples train on the empty caption (ZT_CAPTION_DROPOUT) is a
function of (seed, epoch, item) alone: `caption_dropped`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from zerotuner.data.files import open_regular
from zerotuner.errors import ConfigError

METADATA_FILE = "metadata.jsonl"
# Tokenizers keep 77 (CLIP) to 512 (T5) tokens, a few KiB of text: a caption is read up to this
# many bytes (a 20 MB caption file once cost 75 s and 4 GiB while caching).
CAPTION_BYTES = 64 * 1024
METADATA_LINE_BYTES = 64 * 2**20  # one metadata.jsonl line; longer is an input error


def read_metadata(
    files: list[Path],
) -> tuple[dict[Path, tuple[str, bool]], dict[Path, list[Path]]]:
    """Captions from every metadata.jsonl (Hugging Face imagefolder layout), by image path:
    (caption, whether it was cut to CAPTION_BYTES); and the control images a row names (an
    edit model's inputs: `control`, a name or a list of names, then `control_1`, ...), by
    image path, in that order.

    `file_name` and the controls are relative to the folder holding the metadata file. A
    malformed, unreadable or overlong line is an input error: silently falling back to file
    names would train on the wrong captions.
    """
    captions: dict[Path, tuple[str, bool]] = {}
    controls: dict[Path, list[Path]] = {}
    for meta in files:
        for number, line in _lines(meta):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                name, text = row["file_name"], row.get("text", row.get("caption"))
                image = (meta.parent / name).resolve()
                named = _control_names(row)
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise ConfigError(
                    f"ZT_DATA_DIR: {meta} line {number}: expected a JSON object with "
                    f'"file_name" and "text", and optionally "control" (a file name or a list '
                    f"of them) ({type(exc).__name__}: {exc})"
                ) from None
            text = "" if text is None else str(text)
            caption, cut = _prefix(text.encode("utf-8", "replace"), CAPTION_BYTES)
            captions[image] = (caption.strip(), cut)
            if named:
                controls[image] = [meta.parent / control for control in named]
    return captions, controls


def _control_names(row: dict[str, object]) -> list[str]:
    """A metadata row's control image names: `control` (one or a list), then `control_1`,
    `control_2`, ... by number."""
    first = row.get("control")
    names = [] if first is None else list(first) if isinstance(first, list) else [first]
    numbered = sorted((int(k[8:]), k) for k in row if re.fullmatch(r"control_\d{1,4}", k))
    names += [row[key] for _, key in numbered]
    if not all(isinstance(name, str) and name for name in names):
        raise TypeError(f"control names must be non-empty strings, got {names!r}")
    return [str(name) for name in names]


def _lines(meta: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of a metadata file, none longer than METADATA_LINE_BYTES."""
    try:
        with open_regular(meta) as reader:
            number = 0
            while raw := reader.readline(METADATA_LINE_BYTES + 1):
                number += 1
                if len(raw) > METADATA_LINE_BYTES:
                    raise ConfigError(
                        f"ZT_DATA_DIR: {meta} line {number}: longer than "
                        f"{METADATA_LINE_BYTES // 2**20} MiB; captions are cut to "
                        f"{CAPTION_BYTES // 1024} KiB anyway, shorten it"
                    )
                yield number, raw.decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(
            f"ZT_DATA_DIR: {meta}: unreadable ({exc.strerror or exc}); it holds captions"
        ) from None


def read_caption(
    path: Path,
    root: Path,
    sidecars: set[Path],
    metadata: dict[Path, tuple[str, bool]],
    skipped: list[tuple[Path, str]],
    extension: str = ".txt",
) -> tuple[str, str | None]:
    """Sidecar .txt (or `extension`) first, then metadata.jsonl, then the file name; with
    where the caption came from when it was cut to CAPTION_BYTES. An unreadable sidecar joins
    `skipped`."""
    sidecar = path.with_suffix(extension)
    if sidecar in sidecars:
        try:
            with open_regular(sidecar) as reader:
                text, cut = _prefix(reader.read(CAPTION_BYTES + 1), CAPTION_BYTES)
            return text.strip(), sidecar.relative_to(root).as_posix() if cut else None
        except OSError as exc:
            skipped.append((sidecar, f"unreadable ({exc.strerror or exc})"))
    found = metadata.get(path.resolve())
    if found is not None:
        where = f"{path.relative_to(root).as_posix()} in {METADATA_FILE}"
        return found[0], where if found[1] else None
    words = [w for w in re.split(r"[\s_\-.]+", path.stem) if w and not w.isdigit()]
    return " ".join(words), None


def _prefix(raw: bytes, limit: int) -> tuple[str, bool]:
    """UTF-8 text of at most `limit` bytes of raw, and whether it was cut."""
    if len(raw) <= limit:
        return raw.decode("utf-8", errors="replace"), False
    return raw[:limit].decode("utf-8", errors="ignore"), True  # no half character at the end


def apply_template(template: str, caption: str) -> str:
    """The caption in ZT_CAPTION_TEMPLATE's `{caption}` (plain replacement: other braces are
    text), stripped: `sks {caption}` and an image without a caption train on `sks`."""
    return template.replace("{caption}", caption, 1).strip()


def caption_dropped(seed: int, epoch: int, index: int, probability: float) -> bool:
    """Whether item `index` trains on the empty caption in `epoch` (ZT_CAPTION_DROPOUT).

    A pure function of (seed, epoch, item): the same on every rank, for any world size and
    after a resume, with no state to checkpoint; a new draw each epoch. An item that appears
    twice in an epoch (a batch topped up from its bucket) gets the same answer both times.
    """
    if probability <= 0:
        return False
    if probability >= 1:
        return True
    key = f"caption-dropout/{seed}/{epoch}/{index}".encode()
    draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
    return draw < probability
