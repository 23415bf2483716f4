"""Each data file decoded once, when the data is scanned, and what that found remembered.

An image is fully decoded (a clip as far as training reads it, `clips.probe`), so a truncated
or hostile file is found here, not mid-training. The results are kept in a scan index outside
the possibly read-only data folder (`index_path`), by (path, size, mtime): a restart decodes
only new or changed files.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from zerotuner.data import clips
from zerotuner.data.files import open_regular
from zerotuner.settings.video_windows import HEAD

log = logging.getLogger(__name__)

PIL_FORMATS = {"PNG", "JPEG", "MPO", "WEBP"}  # MPO: multi-picture JPEG from phone cameras
EXIF_ORIENTATION = 0x0112
IMAGE_BYTES = 2 * 2**30  # above PIL's pixel limit (~179 MP) even uncompressed at 16-bit RGBA


@dataclass(frozen=True)
class Probe:
    """What decoding one file found: its size and digest, or why it cannot be used."""

    file_size: int
    mtime_ns: int
    size: tuple[int, int] | None  # (w, h) after EXIF orientation; None when skipped
    digest: str = ""
    reason: str = ""
    frames: int = 1  # a clip's frames trained per window
    available: int = 1  # a clip's sampled frames, as far as it was read (its windows lie there)


def probe_files(
    root: Path,
    paths: Sequence[Path],
    *,
    video: clips.Video | None,
    index: Path | None,
    write_index: bool,
    workers: int | None,
) -> list[Probe]:
    """Each of `paths` (under root) probed, in order, on `workers` threads; a file the
    `index` holds unchanged is not decoded again. Only `write_index` rewrites the index, when
    anything changed (let one rank write it)."""
    known = _read_index(index, root, video) if index else {}
    names = [path.relative_to(root).as_posix() for path in paths]

    def remembered_or_probed(path: Path, name: str) -> Probe:
        previous = known.get(name)
        if previous is not None:
            try:
                info = path.stat()
            except OSError:
                pass
            else:
                if (info.st_size, info.st_mtime_ns) == (previous.file_size, previous.mtime_ns):
                    return previous
        return probe(path, video)

    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:  # PIL decodes without the GIL
        probes = list(pool.map(remembered_or_probed, paths, names))
    keyed = dict(zip(names, probes, strict=True))
    if index and write_index and any(known.get(k) != p for k, p in keyed.items()):
        _write_index(index, root, keyed, video)
    return probes


def probe(path: Path, video: clips.Video | None) -> Probe:
    """A clip's probe when `video` samples clips, else an image's; never raises for a bad
    file."""
    if video and path.suffix.lower() in clips.CLIP_SUFFIXES:
        found = clips.probe(
            path, fps=video.fps, frames=video.frames, step=video.step, windows=video.windows
        )
        return Probe(found.file_size, found.mtime_ns, found.size, found.digest,
                     found.reason, found.frames, found.available)  # fmt: skip
    return _probe_image(path)


def _probe_image(path: Path) -> Probe:
    try:
        with open_regular(path) as reader:
            info = os.fstat(reader.fileno())
            data = reader.read() if info.st_size <= IMAGE_BYTES else b""
    except OSError as exc:
        return Probe(-1, -1, None, reason=f"unreadable ({exc.strerror or exc})")
    stamp = (info.st_size, info.st_mtime_ns)
    if info.st_size > IMAGE_BYTES:
        return Probe(*stamp, None, reason=f"too large (over {IMAGE_BYTES // 2**30} GiB)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in PIL_FORMATS:
                return Probe(*stamp, None, reason=f"{image.format} data, not PNG, JPEG or WebP")
            image.load()  # raises on truncated or corrupt data
            size = image.size
            if image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8):  # rotated 90 degrees
                size = (size[1], size[0])
    except UnidentifiedImageError:
        return Probe(*stamp, None, reason="not an image (unrecognised data)")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        kind = "truncated" if "truncated" in str(exc) else "unreadable"
        return Probe(*stamp, None, reason=f"{kind} ({exc})")
    return Probe(*stamp, size, hashlib.blake2b(data, digest_size=16).hexdigest())


def index_path(cache_dir: Path, folder: Path) -> Path:
    """Where a folder's scan results are kept between starts (outside the data)."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return cache_dir / "features" / "scans" / f"{key}.json"


def _read_index(index: Path, root: Path, video: clips.Video | None) -> dict[str, Probe]:
    """A previous scan's results (for the same clip sampling); anything unexpected just
    means decoding again."""
    try:
        content = json.loads(index.read_text())
        if content.get("root") != str(root.resolve()):
            return {}
        if content.get("video") != _sampling(video):
            return {}
        return {
            key: Probe(e[0], e[1], tuple(e[2]) if e[2] else None, e[3], e[4], *e[5:7])
            for key, e in content["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def _sampling(video: clips.Video | None) -> list[float | str] | None:
    """What a clip's probe depends on besides the file: a scan index of other sampling, of
    other windows (read to the clip's end or not), or of another bound on a clip, is not
    reused."""
    if video is None:
        return None
    read = "head" if video.windows == HEAD else f"to {clips.MAX_SAMPLED_FRAMES}"
    return [video.fps, video.frames, video.step, clips.MAX_CLIP_PIXELS, read]


def _write_index(
    index: Path, root: Path, probes: dict[str, Probe], video: clips.Video | None
) -> None:
    files = {
        k: [p.file_size, p.mtime_ns, p.size, p.digest, p.reason, p.frames, p.available]
        for k, p in probes.items()
    }
    content = {"root": str(root.resolve()), "video": _sampling(video), "files": files}
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(content))
        os.replace(tmp, index)  # readers on other ranks see the old or the new file, whole
    except OSError as exc:
        log.warning("could not write the dataset index %s: %s", index, exc)
