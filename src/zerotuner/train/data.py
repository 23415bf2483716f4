"""The dataset layer: find images and captions, bucket them by aspect ratio, order batches.

Pure Python + PIL + numpy and no torch.distributed: every rank calls the same functions on the
same folder and gets the same answer, so ranks agree on the data without talking. The latent
cache (in the training worker) keys entries on what `scan` records per file.

Order of a training epoch, independent of the world size: each aspect bucket is shuffled by
(seed, epoch) and cut into full micro-batches (the last one topped up from the same bucket),
then all batches are shuffled together. Ranks take every world_size-th batch, and the list is
topped up so every rank gets the same number of batches (ranks must step together). Which
samples train on the empty caption (ZT_CAPTION_DROPOUT) is likewise a function of (seed,
epoch, item) alone: `caption_dropped`.

Several datasets (ZT_DATASETS_FILE) are scanned one by one (`scan_sources`) and joined into one
Dataset whose `parts` keep each one's repeats and resolution: `dataset_buckets` lists an item
once per repeat, so the order above needs nothing else. A loss mask is an image beside its
picture, `foo.mask.png` for `foo.jpg`: white trains, black is left out (`Item.mask`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from zerotuner.errors import ConfigError
from zerotuner.settings.datasets import DatasetSource, local_folder
from zerotuner.train import clips

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
PIL_FORMATS = {"PNG", "JPEG", "MPO", "WEBP"}  # MPO: multi-picture JPEG from phone cameras
METADATA_FILE = "metadata.jsonl"
COMPANION_SUFFIXES = {".txt", ".jsonl", ".json", ".md", ".yaml", ".yml", ".toml"}
EXIF_ORIENTATION = 0x0112
# Tokenizers keep 77 (CLIP) to 512 (T5) tokens, a few KiB of text: a caption is read up to this
# many bytes (a 20 MB caption file once cost 75 s and 4 GiB while caching).
CAPTION_BYTES = 64 * 1024
METADATA_LINE_BYTES = 64 * 2**20  # one metadata.jsonl line; longer is an input error
IMAGE_BYTES = 2 * 2**30  # above PIL's pixel limit (~179 MP) even uncompressed at 16-bit RGBA
# /data is often a mount: a link leading out of it reads files the user did not mean to train on.
LINK_OUT = "links outside the data folder"
SUMMARY_EXAMPLES = 3  # paths named per kind of skipped file
SUMMARY_KINDS = 8  # kinds of skipped file listed, one line each
UPSCALE_NOTICE = 1.1  # enlarging an image by more than this is worth a warning
SMALL = "smaller than ZT_MIN_IMAGE_SIZE"  # the skip reason of an image below it
MASK_SUFFIX = ".mask"  # foo.mask.png weights the loss of foo.png / foo.jpg
Size = tuple[int, int]  # (width, height) in pixels
# A bucket: (width, height), and for clips of more than one frame (width, height, frames).
Bucket = tuple[int, ...]


@dataclass(frozen=True)
class Video:
    """How a video family trains clips (ZT_VIDEO_FPS, ZT_VIDEO_FRAMES, and `step`, the
    model's frame rule: step * k + 1 frames). A scan without it is an image family's."""

    fps: float
    frames: int
    step: int


def video_sampling(settings: object, family: object, source: Path) -> Video | None:
    """How this run samples clips: for a video family (its `frame_step`), ZT_VIDEO_FPS and
    ZT_VIDEO_FRAMES; None for an image family. `train` and `check` both ask here."""
    step = family.frame_step(Path(source))
    return Video(settings.video_fps, settings.video_frames, step) if step else None


@dataclass(frozen=True)
class Item:
    """One usable image. `digest` identifies the content, so a cache survives `touch` and copies."""

    path: Path
    caption: str
    size: Size  # (w, h) after EXIF orientation
    file_size: int
    mtime_ns: int
    digest: str  # blake2b-128 of the file bytes
    name: str = ""  # the path relative to its dataset's folder: the cache's name for it
    mask: Path | None = None  # its loss mask (foo.mask.png)
    mask_digest: str = ""
    frames: int = 1  # a clip's frames trained (clips.trained_frames); an image is one
    fps: float = 0.0  # the rate a clip's frames are sampled at; 0 for an image

    @property
    def content(self) -> str:
        """What the cached latents depend on besides the bucket: the image and its mask, or
        the clip and the rate its frames are sampled at."""
        if self.fps:
            return f"{self.digest}@{self.fps:g}fps"
        return f"{self.digest}+{self.mask_digest}" if self.mask else self.digest

    @property
    def clip(self) -> bool:
        return self.path.suffix.lower() in clips.CLIP_SUFFIXES


@dataclass(frozen=True)
class Part:
    """One dataset of several: where its items start in the joined Dataset, how often each
    trains an epoch, and its resolution (None: the job's)."""

    label: str  # its path as the datasets file gives it
    dataset: Dataset
    start: int
    repeats: int = 1
    resolution: int | None = None


@dataclass(frozen=True)
class Dataset:
    root: Path
    items: tuple[Item, ...]
    skipped: tuple[tuple[Path, str], ...]  # (path, reason) for every file left out
    cut_captions: tuple[str, ...] = ()  # where a caption over CAPTION_BYTES was cut short
    parts: tuple[Part, ...] = ()  # several datasets: each one's own scan

    def __len__(self) -> int:
        return len(self.items)

    @property
    def epoch_samples(self) -> int:
        """Samples an epoch trains: each item once per repeat of its dataset (before the last
        batch of each bucket is topped up)."""
        if not self.parts:
            return len(self.items)
        return sum(len(p.dataset) * p.repeats for p in self.parts)

    def warnings(self) -> list[str]:
        """What a user should know about this folder, in a few lines however many files:
        one line per kind of skipped file, one for captions cut short (per dataset)."""
        if self.parts:
            return [f"{p.label}: {line}" for p in self.parts for line in p.dataset.warnings()]
        lines = skip_summary(self.root, self.skipped)
        if self.cut_captions:
            lines.append(
                f"{_count(len(self.cut_captions), 'caption')} longer than "
                f"{CAPTION_BYTES // 1024} KiB cut to that (the tokenizer keeps far less): "
                + _examples(self.cut_captions)
            )
        return lines

    def summary(self) -> str:
        """`12 images in /data` (`10 images and 4 clips (2.5 s) in /data`), or per dataset
        with its repeats."""
        if not self.parts:
            return f"{_contents(self.items)} in {self.root}"
        shown = []
        for p in self.parts:
            extra = [f"x{p.repeats}"] if p.repeats > 1 else []
            extra += [f"{p.resolution} px"] if p.resolution else []
            more = f" ({', '.join(extra)})" if extra else ""
            shown.append(f"{_contents(p.dataset.items)} in {p.label}{more}")
        return f"{_contents(self.items)} in {len(self.parts)} datasets: " + ", ".join(shown)


def _contents(items: Sequence[Item]) -> str:
    """`12 images`, or with clips `10 images and 4 clips (2.5 s)`: the seconds they train."""
    clips_in = [item for item in items if item.clip]
    images = _count(len(items) - len(clips_in), "image")
    if not clips_in:
        return images
    seconds = sum((item.frames - 1) / item.fps for item in clips_in if item.fps)
    return f"{images} and {_count(len(clips_in), 'clip')} ({seconds:.1f} s)"


@dataclass(frozen=True)
class Example:
    """One image ready for the VAE, with SDXL's size/crop micro-conditioning."""

    pixels: np.ndarray  # float32, CHW, RGB in [-1, 1]
    caption: str
    original_size: Size  # (h, w) of the source image after EXIF orientation
    crop_top_left: Size  # (top, left) of the crop in the resized image
    target_size: Size  # (h, w) of the bucket
    mask: np.ndarray | None = None  # float32 (1, H, W) in [0, 1], cropped as the pixels


# --- scanning ---------------------------------------------------------------------------------


def scan(
    data_dir: Path,
    *,
    log_skipped: bool = True,
    index: Path | None = None,
    write_index: bool = True,
    workers: int | None = None,
    caption_template: str | None = None,
    min_image_size: int = 0,
    caption_extension: str = ".txt",
    setting: str = "ZT_DATA_DIR",
    video: Video | None = None,
) -> Dataset:
    """Find every readable PNG/JPEG/WebP under data_dir (recursively), with its caption.

    Each image is fully decoded once, so a truncated file is found here, not mid-training.
    With `index` (a JSON file outside the possibly read-only data dir) the results are
    remembered by (path, size, mtime) and a restart decodes only new or changed files; let one
    rank write it (`write_index`). Files that fail are skipped with one warning each (set
    log_skipped=False on all ranks but one) and listed in `Dataset.skipped`, as are images
    whose short side is below `min_image_size` (ZT_MIN_IMAGE_SIZE). Each caption goes through
    `caption_template` (ZT_CAPTION_TEMPLATE), so the text cache holds what is trained on.
    Captions are read from `caption_extension` sidecars; `foo.mask.png` is foo's loss mask. No
    usable image is a ConfigError (exit 2) naming `setting`.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ConfigError(
            f"{setting}={data_dir}: no such directory; mount a folder of PNG, JPEG or WebP "
            "images (captions in sidecar .txt files or metadata.jsonl) there"
        )
    files, skipped = _walk(data_dir)
    metadata = _read_metadata([p for p in files if p.name == METADATA_FILE])
    sidecars = {p for p in files if p.suffix == caption_extension}
    candidates: list[Path] = []
    masks: dict[Path, Path] = {}  # image stem path -> its mask
    for path in files:
        suffix = path.suffix.lower()
        if (picture := _masked(path)) is not None:
            masks[picture] = path
        elif suffix in IMAGE_SUFFIXES or (video and suffix in clips.CLIP_SUFFIXES):
            candidates.append(path)
        elif suffix in clips.CLIP_SUFFIXES:
            skipped.append((path, "video clips (ZT_MODEL is an image model: they train video "
                                  "families such as Wan)"))  # fmt: skip
        elif suffix not in COMPANION_SUFFIXES and path in sidecars:
            continue
        elif suffix not in COMPANION_SUFFIXES:
            kind = f"'{suffix}' files" if suffix else "files without a suffix"
            skipped.append((path, f"{kind} are not read (PNG, JPEG or WebP are)"))
    known = _read_index(index, data_dir, video) if index else {}

    def probe(path: Path) -> _Probe:
        previous = known.get(path.relative_to(data_dir).as_posix())
        if previous is not None:
            try:
                stat = path.stat()
            except OSError:
                pass
            else:
                if (stat.st_size, stat.st_mtime_ns) == (previous.file_size, previous.mtime_ns):
                    return previous
        if video and path.suffix.lower() in clips.CLIP_SUFFIXES:
            found = clips.probe(path, fps=video.fps, frames=video.frames, step=video.step)
            return _Probe(found.file_size, found.mtime_ns, found.size, found.digest,
                          found.reason, found.frames)  # fmt: skip
        return _probe(path)

    paired = {
        path: masks.pop(path.with_suffix(""), None) if path.suffix.lower() in IMAGE_SUFFIXES
        else None
        for path in candidates
    }  # fmt: skip
    # A mask the walk left out (a FIFO, a link out, a dangling link, a folder) still says
    # which part of its picture must not train: the picture is left out with it.
    unusable = {picture: why for path, why in skipped if (picture := _masked(path)) is not None}
    skipped += [(mask, "masks without an image of the same name") for mask in masks.values()]
    mask_files = [m for m in paired.values() if m is not None]
    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:  # PIL decodes without the GIL
        probed = list(pool.map(probe, candidates + mask_files))
    probed, mask_probes = (
        probed[: len(candidates)],
        dict(zip(mask_files, probed[len(candidates) :], strict=True)),
    )
    candidates_and_masks = candidates + mask_files
    all_probes = probed + list(mask_probes.values())
    keyed = dict(_keyed(data_dir, candidates_and_masks, all_probes))
    if index and write_index and any(known.get(k) != p for k, p in keyed.items()):
        _write_index(index, data_dir, keyed, video)
    items, cut = [], []
    for path, result in zip(candidates, probed, strict=True):
        if result.size is None:
            skipped.append((path, result.reason))
            continue
        if min(result.size) < min_image_size:
            w, h = result.size
            why = f"{SMALL}={min_image_size} px on the short side"
            skipped.append((path, f"{why} ({w}x{h})"))
            continue
        mask = paired[path]
        if mask is not None and mask_probes[mask].size is None:
            skipped.append((path, f"its mask is unusable ({mask_probes[mask].reason})"))
            continue
        why = unusable.get(path.with_suffix("")) if path.suffix.lower() in IMAGE_SUFFIXES else None
        if mask is None and why:
            skipped.append((path, f"its mask is unusable ({why})"))
            continue
        caption, cut_at = _caption(path, data_dir, sidecars, metadata, skipped, caption_extension)
        if cut_at:
            cut.append(cut_at)
        if caption_template is not None:
            caption = apply_template(caption_template, caption)
        items.append(
            Item(
                path, caption, result.size, result.file_size, result.mtime_ns, result.digest,
                name=path.relative_to(data_dir).as_posix(), mask=mask,
                mask_digest=mask_probes[mask].digest if mask else "", frames=result.frames,
                fps=video.fps if video and path.suffix.lower() in clips.CLIP_SUFFIXES else 0.0,
            )
        )  # fmt: skip
    skipped.sort()
    dataset = Dataset(data_dir, tuple(items), tuple(skipped), tuple(sorted(cut)))
    if not items:
        found = f"; {len(skipped)} file(s) skipped, listed below" if skipped else ""
        raise ConfigError(
            "",
            problems=[
                f"ZT_DATA_DIR={data_dir}: no usable images{found}; expected PNG, JPEG or WebP "
                "files (searched recursively) with captions in sidecar .txt files or "
                "metadata.jsonl",
                *dataset.warnings(),
            ],
        )
    if log_skipped:
        for line in dataset.warnings():
            log.warning("%s", line)
    return dataset


def scan_sources(
    sources: Sequence[DatasetSource],
    cache_dir: Path,
    *,
    log_skipped: bool = True,
    write_index: bool = True,
    min_image_size: int = 0,
    video: Video | None = None,
    datasets_file: Path | None = None,
) -> Dataset:
    """Every dataset of the run scanned (`scan`) and joined: one dataset as it is, several
    into a Dataset whose `parts` keep each one's repeats and resolution. A remote dataset is
    read from its fetched copy (settings.datasets.local_folder); `preflight.fetch` made it.
    `datasets_file` (ZT_DATASETS_FILE): what an error names instead of ZT_DATA_DIR."""
    scanned = []
    for source in sources:
        folder = local_folder(source, cache_dir)
        if source.location.remote and not (folder / FETCHED).is_file():
            raise ConfigError(
                f"{source.path}: not fetched into {folder} yet; `zerotuner train` fetches it "
                "on each node before the ranks start"
            )
        setting = f"ZT_DATASETS_FILE={datasets_file}: path" if datasets_file else "ZT_DATA_DIR"
        scanned.append(
            scan(
                folder,
                log_skipped=False,
                write_index=write_index,
                caption_template=source.caption_template,
                min_image_size=min_image_size,
                caption_extension=source.caption_extension,
                setting=setting,
                index=_index_path(cache_dir, folder),
                video=video,
            )  # fmt: skip
        )
    if len(scanned) == 1 and sources[0].repeats == 1 and sources[0].resolution is None:
        dataset = scanned[0]
    else:
        parts, items, start = [], [], 0
        for source, part in zip(sources, scanned, strict=True):
            parts.append(Part(source.path, part, start, source.repeats, source.resolution))
            items += part.items
            start += len(part)
        skipped = tuple(s for part in scanned for s in part.skipped)
        cut = tuple(c for part in scanned for c in part.cut_captions)
        dataset = Dataset(scanned[0].root, tuple(items), skipped, cut, tuple(parts))
    if log_skipped:
        for line in dataset.warnings():
            log.warning("%s", line)
    return dataset


FETCHED = ".zerotuner-fetched"  # in a remote dataset's copy once every file is in place


def listed_samples(
    sources: Sequence[DatasetSource], cache_dir: Path, *, video: bool = False
) -> int | None:
    """Samples an epoch as the file names tell, nothing decoded (`plan`; `check` scans): each
    dataset's pictures (and clips for a video family) times its repeats. None while a dataset
    is not there, or not fetched yet."""
    suffixes = IMAGE_SUFFIXES + (clips.CLIP_SUFFIXES if video else ())
    total = 0
    for source in sources:
        folder = local_folder(source, cache_dir)
        if not folder.is_dir() or (source.location.remote and not (folder / FETCHED).is_file()):
            return None
        files, _ = _walk(folder)
        pictures = [p for p in files if p.suffix.lower() in suffixes and _masked(p) is None]
        total += len(pictures) * source.repeats
    return total


def _index_path(cache_dir: Path, folder: Path) -> Path:
    """Where a folder's scan results are kept between starts (outside the data)."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return cache_dir / "features" / "scans" / f"{key}.json"


def _walk(root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Regular files under root in a stable order, and the entries left out with why.

    Hidden files and folders are not data. Links are followed while they stay inside the data
    folder (LINK_OUT); each real folder is read once, so a link loop ends. Only regular files
    are kept: a FIFO or a device (a link to /dev/zero) would block or never end. A folder that
    vanishes while it is walked is left out as unreadable, as a vanished file is.
    """
    real_root = root.resolve()
    skipped: list[tuple[Path, str]] = []

    def unreadable(error: OSError) -> None:
        skipped.append((Path(error.filename or root), f"unreadable folder ({error.strerror})"))

    try:
        seen = {_inode(real_root)}
    except OSError as error:
        unreadable(error)
        return [], skipped
    found = []
    for folder, dirs, files in os.walk(root, onerror=unreadable, followlinks=True):
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            path = Path(folder) / name
            real = path.resolve()
            try:
                inode = _inode(real)
            except OSError as error:  # gone since its folder was listed
                skipped.append((path, f"unreadable folder ({error.strerror})"))
                continue
            if not real.is_relative_to(real_root):
                skipped.append((path, LINK_OUT))
            elif _masked(path) is not None:  # `foo.mask.png/`: its picture is left out
                skipped.append((path, "not a regular file (a folder)"))
            elif inode not in seen:  # else read already, through another link
                seen.add(inode)
                kept.append(name)
        dirs[:] = kept
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(folder) / name
            try:
                mode = path.stat().st_mode
            except OSError as exc:
                skipped.append((path, f"unreadable ({exc.strerror or exc})"))
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(real_root):
                skipped.append((path, LINK_OUT))  # (its folder is inside: checked above)
            elif not stat.S_ISREG(mode):
                skipped.append((path, "not a regular file (a FIFO, socket or device)"))
            else:
                found.append(path)
    return found, skipped


def _masked(path: Path) -> Path | None:
    """The picture a mask's name stands for (`a/foo` for `a/foo.mask.png`); None for any
    other name."""
    if path.suffix.lower() in IMAGE_SUFFIXES and path.stem.endswith(MASK_SUFFIX):
        return path.with_name(path.stem.removesuffix(MASK_SUFFIX))
    return None


def _inode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


@contextmanager
def _open_regular(path: Path):
    """A binary reader of a regular file. O_NONBLOCK: a file swapped for a FIFO since the
    walk fails here instead of blocking the scan."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        yield reader


def _prefix(raw: bytes, limit: int) -> tuple[str, bool]:
    """UTF-8 text of at most `limit` bytes of raw, and whether it was cut."""
    if len(raw) <= limit:
        return raw.decode("utf-8", errors="replace"), False
    return raw[:limit].decode("utf-8", errors="ignore"), True  # no half character at the end


def skip_summary(root: Path, skipped: Sequence[tuple[Path, str]]) -> list[str]:
    """One line per kind of skipped file (the reason before its parenthesis): how many, and the
    first few paths. Ten thousand unreadable files make one line, not ten thousand."""
    kinds: dict[str, list[tuple[str, str]]] = {}
    for path, reason in skipped:
        kind, _, detail = reason.partition(" (")
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        kinds.setdefault(kind, []).append((name, detail.removesuffix(")")))
    lines = []
    for kind, entries in sorted(kinds.items(), key=lambda k: -len(k[1]))[:SUMMARY_KINDS]:
        details = {detail for _, detail in entries}
        if len(details) == 1 and (detail := details.pop()):
            kind, names = f"{kind} ({detail})", [name for name, _ in entries]
        else:
            names = [f"{n} ({d})" if d else n for n, d in entries]
        lines.append(f"skipped {_count(len(entries), 'file')}, {kind}: {_examples(names)}")
    if len(kinds) > SUMMARY_KINDS:
        rest = sorted(kinds.items(), key=lambda k: -len(k[1]))[SUMMARY_KINDS:]
        lines.append(
            f"skipped {_count(sum(len(e) for _, e in rest), 'more file')} of "
            f"{len(rest)} other kinds"
        )
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _examples(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SUMMARY_EXAMPLES])
    more = len(names) - SUMMARY_EXAMPLES
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class _Probe:
    """What decoding one file found: its size and digest, or why it cannot be used."""

    file_size: int
    mtime_ns: int
    size: Size | None  # (w, h) after EXIF orientation; None when skipped
    digest: str = ""
    reason: str = ""
    frames: int = 1  # a clip's frames trained


def _probe(path: Path) -> _Probe:
    try:
        with _open_regular(path) as reader:
            info = os.fstat(reader.fileno())
            data = reader.read() if info.st_size <= IMAGE_BYTES else b""
    except OSError as exc:
        return _Probe(-1, -1, None, reason=f"unreadable ({exc.strerror or exc})")
    stamp = (info.st_size, info.st_mtime_ns)
    if info.st_size > IMAGE_BYTES:
        return _Probe(*stamp, None, reason=f"too large (over {IMAGE_BYTES // 2**30} GiB)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in PIL_FORMATS:
                return _Probe(*stamp, None, reason=f"{image.format} data, not PNG, JPEG or WebP")
            image.load()  # raises on truncated or corrupt data
            size = image.size
            if image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8):  # rotated 90 degrees
                size = (size[1], size[0])
    except UnidentifiedImageError:
        return _Probe(*stamp, None, reason="not an image (unrecognised data)")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        kind = "truncated" if "truncated" in str(exc) else "unreadable"
        return _Probe(*stamp, None, reason=f"{kind} ({exc})")
    return _Probe(*stamp, size, hashlib.blake2b(data, digest_size=16).hexdigest())


def _keyed(root: Path, paths: list[Path], probes: list[_Probe]):
    return ((p.relative_to(root).as_posix(), r) for p, r in zip(paths, probes, strict=True))


def _read_index(index: Path, root: Path, video: Video | None = None) -> dict[str, _Probe]:
    """A previous scan's results (for the same clip sampling); anything unexpected just
    means decoding again."""
    try:
        content = json.loads(index.read_text())
        if content.get("root") != str(root.resolve()):
            return {}
        if content.get("video") != _sampling(video):
            return {}
        return {
            key: _Probe(e[0], e[1], tuple(e[2]) if e[2] else None, e[3], e[4], *e[5:6])
            for key, e in content["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def _sampling(video: Video | None) -> list | None:
    """What a clip's probe depends on besides the file: a scan index of other sampling, or
    of another bound on a whole clip, is not reused."""
    if video is None:
        return None
    return [video.fps, video.frames, video.step, clips.MAX_CLIP_PIXELS]


def _write_index(
    index: Path, root: Path, probes: dict[str, _Probe], video: Video | None = None
) -> None:
    files = {
        k: [p.file_size, p.mtime_ns, p.size, p.digest, p.reason, p.frames]
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


def _read_metadata(files: list[Path]) -> dict[Path, tuple[str, bool]]:
    """Captions from every metadata.jsonl (Hugging Face imagefolder layout), by image path:
    (caption, whether it was cut to CAPTION_BYTES).

    `file_name` is relative to the folder holding the metadata file. A malformed, unreadable
    or overlong line is an input error: silently falling back to file names would train on
    the wrong captions.
    """
    captions: dict[Path, tuple[str, bool]] = {}
    for meta in files:
        for number, line in _lines(meta):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                name, text = row["file_name"], row.get("text", row.get("caption"))
                image = (meta.parent / name).resolve()
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise ConfigError(
                    f"ZT_DATA_DIR: {meta} line {number}: expected a JSON object with "
                    f'"file_name" and "text" ({type(exc).__name__}: {exc})'
                ) from None
            text = "" if text is None else str(text)
            caption, cut = _prefix(text.encode("utf-8", "replace"), CAPTION_BYTES)
            captions[image] = (caption.strip(), cut)
    return captions


def _lines(meta: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of a metadata file, none longer than METADATA_LINE_BYTES."""
    try:
        with _open_regular(meta) as reader:
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


def _caption(
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
            with _open_regular(sidecar) as reader:
                text, cut = _prefix(reader.read(CAPTION_BYTES + 1), CAPTION_BYTES)
            return text.strip(), sidecar.relative_to(root).as_posix() if cut else None
        except OSError as exc:
            skipped.append((sidecar, f"unreadable ({exc.strerror or exc})"))
    caption = metadata.get(path.resolve())
    if caption is not None:
        where = f"{path.relative_to(root).as_posix()} in {METADATA_FILE}"
        return caption[0], where if caption[1] else None
    words = [w for w in re.split(r"[\s_\-.]+", path.stem) if w and not w.isdigit()]
    return " ".join(words), None


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


# --- aspect-ratio buckets -------------------------------------------------------------------


def bucket_sizes(resolution: int, *, multiple: int = 64, max_aspect: float = 4.0) -> list[Size]:
    """(w, h) pairs, sides multiples of `multiple`, area at most resolution**2 and close to it.

    For each short side the longest fitting long side is taken (both orientations), so every
    bucket holds about the trained number of pixels; ratios beyond max_aspect are left out.
    """
    if multiple <= 0 or resolution < multiple:
        raise ConfigError(
            f"ZT_RESOLUTION={resolution}: must be at least the bucket step {multiple} pixels"
        )
    area = resolution * resolution
    square = resolution // multiple * multiple
    sizes = {(square, square)}
    for short in range(multiple, resolution + 1, multiple):
        long = area // short // multiple * multiple
        if long / short <= max_aspect:
            sizes.update({(short, long), (long, short)})
    return sorted(sizes)


def nearest_bucket(size: Size, buckets: Sequence[Size]) -> Size:
    """The bucket whose aspect ratio is closest in log space (ties: the larger area)."""
    ratio = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ratio), -b[0] * b[1], b))


def native_bucket(
    size: Size, bucket: Size, *, resolution: int, multiple: int = 64, max_aspect: float = 4.0
) -> Size:
    """The bucket of an image with ZT_UPSCALE=false: `bucket` (its nearest) when the image
    covers it, else the image's own size rounded down to `multiple` per side -- the long side
    cut to max_aspect times the short one, the area kept within resolution**2 -- so it is
    shrunk a little and cropped, never enlarged. A side shorter than one step becomes the step
    (the one enlargement left; `upscale_warning` names those)."""
    (w, h), (bw, bh) = size, bucket
    if w >= bw and h >= bh:
        return bucket
    nw, nh = (max(multiple, side // multiple * multiple) for side in size)
    limit = max(multiple, int(min(nw, nh) * max_aspect) // multiple * multiple)
    nw, nh = min(nw, limit), min(nh, limit)
    while nw * nh > resolution * resolution and max(nw, nh) > multiple:
        nw, nh = (nw - multiple, nh) if nw >= nh else (nw, nh - multiple)
    return nw, nh


def assign_buckets(
    items: Sequence[Item],
    resolution: int,
    *,
    multiple: int = 64,
    max_aspect: float = 4.0,
    upscale: bool = True,
) -> dict[Size, list[int]]:
    """Item indices grouped by bucket (w, h); only buckets in use, in sorted order.

    `multiple` must keep latents divisible by the UNet's downsampling: pass
    vae_scale * 2 ** (len(unet.block_out_channels) - 1) or a multiple of it (64 for SDXL).
    `upscale` False (ZT_UPSCALE): an image smaller than its bucket gets one of its own size
    (`native_bucket`) instead of being enlarged to cover it.
    """
    sizes = bucket_sizes(resolution, multiple=multiple, max_aspect=max_aspect)
    groups: dict[Size, list[int]] = {}
    for index, item in enumerate(items):
        if item is None:  # another dataset's (dataset_buckets)
            continue
        bucket = nearest_bucket(item.size, sizes)
        if not upscale:
            bucket = native_bucket(
                item.size, bucket, resolution=resolution, multiple=multiple, max_aspect=max_aspect
            )
        key = bucket if item.frames == 1 else (*bucket, item.frames)  # clips: by frames too
        groups.setdefault(key, []).append(index)
    return dict(sorted(groups.items()))


def bucket_name(bucket: Bucket) -> str:
    """`96x64`, or a clip bucket's `96x64x17` (width x height x frames)."""
    return "x".join(str(side) for side in bucket)


def dataset_buckets(
    dataset: Dataset,
    resolution: int,
    *,
    multiple: int = 64,
    max_aspect: float = 4.0,
    upscale: bool = True,
) -> dict[Size, list[int]]:
    """`assign_buckets` over every dataset of the run at its own resolution, each item listed
    once per repeat: the epoch order (`epoch_batches`) then trains it that often."""
    if not dataset.parts:
        return assign_buckets(
            dataset.items, resolution, multiple=multiple, max_aspect=max_aspect, upscale=upscale
        )
    groups: dict[Size, list[int]] = {}
    for part in dataset.parts:
        # placeholders keep the joined dataset's indices
        items = [None] * part.start + list(part.dataset.items)
        own = assign_buckets(
            items, part.resolution or resolution, multiple=multiple, max_aspect=max_aspect,
            upscale=upscale,
        )  # fmt: skip
        for size, indices in own.items():
            groups.setdefault(size, []).extend(indices * part.repeats)
    return dict(sorted(groups.items()))


def upscale_warning(
    dataset: Dataset, resolution: int, *, multiple: int = 64, upscale: bool = True
) -> str | None:
    """A line saying how many images are enlarged by more than 10% to cover their bucket at
    this resolution, and by how much at most (upscaled images teach blur); None if none.
    With `upscale` False only images with a side below one bucket step are enlarged."""
    buckets = dataset_buckets(dataset, resolution, multiple=multiple, upscale=upscale)
    scales = [
        max(bucket[0] / dataset.items[i].size[0], bucket[1] / dataset.items[i].size[1])
        for bucket, indices in buckets.items()
        for i in set(indices)  # an image repeated is enlarged once
    ]
    upscaled = [scale for scale in scales if scale > UPSCALE_NOTICE]
    if not upscaled:
        return None
    if not upscale:
        return (
            f"{len(upscaled)} of {len(scales)} images have a side below the bucket step "
            f"{multiple} px and will be upscaled to it (up to {max(upscaled):.1f}x) despite "
            f"ZT_UPSCALE=false: leave them out with ZT_MIN_IMAGE_SIZE={multiple}"
        )
    return (
        f"{len(upscaled)} of {len(scales)} images are smaller than {resolution} px and will be "
        f"upscaled (up to {max(upscaled):.1f}x): use larger images or a lower ZT_RESOLUTION, "
        "train them at their own size (ZT_UPSCALE=false) or leave them out (ZT_MIN_IMAGE_SIZE)"
    )


def recipe_notes(
    dataset: Dataset,
    resolution: int | None,
    *,
    multiple: int = 64,
    caption_template: str | None = None,
    caption_dropout: float = 0.0,
    min_image_size: int = 0,
    upscale: bool = True,
    timestep_range: str | None = None,
) -> list[str]:
    """What the recipes in force do to this dataset, a few words each (for `check` and the
    log): the caption template, the dropout, the images left out or kept at their size, the
    part of the noise schedule trained."""
    notes = []
    if caption_template:
        notes.append(f"captions as {caption_template!r}")
    if caption_dropout:
        notes.append(f"{caption_dropout * 100:g}% of samples an epoch on the empty caption")
    if min_image_size:
        small = sum(why.startswith(SMALL) for _, why in dataset.skipped)
        notes.append(f"{_count(small, 'image')} under {min_image_size} px left out")
    if not upscale and resolution:
        standard = set(bucket_sizes(resolution, multiple=multiple))
        buckets = dataset_buckets(dataset, resolution, multiple=multiple, upscale=False)
        native = sum(len(set(ix)) for size, ix in buckets.items() if size[:2] not in standard)
        its = "its" if native == 1 else "their"
        notes.append(f"{_count(native, 'image')} not upscaled (trained at {its} own size)")
    if timestep_range:
        notes.append(f"noise schedule {timestep_range} only")
    if masked := sum(item.mask is not None for item in dataset.items):
        notes.append(f"{_count(masked, 'image')} with a loss mask")
    return notes


# --- loading one example ------------------------------------------------------------------------


def load_example(item: Item, bucket_size: Bucket, *, flip: bool = False) -> Example:
    """RGB pixels resized to cover the bucket, center-cropped, optionally mirrored: (C, H, W),
    or a clip bucket's frames each so: (C, F, H, W). A one-frame clip is in an image's bucket
    and is shaped as an image, so the two batch together."""
    bw, bh = bucket_size[:2]
    w, h = item.size
    scale = max(bw / w, bh / h)
    nw, nh = max(bw, round(w * scale)), max(bh, round(h * scale))
    left, top = (nw - bw) // 2, (nh - bh) // 2

    def fit(
        picture: Image.Image, resample: Image.Resampling = Image.Resampling.LANCZOS
    ) -> Image.Image:
        """The part of `picture` (any size: stretched over the item) that covers the bucket,
        resized straight to the bucket: no picture at the covering size is ever made."""
        pw, ph = picture.size
        box = (left * pw / nw, top * ph / nh, (left + bw) * pw / nw, (top + bh) * ph / nh)
        gap = 3.0 if resample == Image.Resampling.LANCZOS else None
        picture = picture.resize((bw, bh), resample, box=box, reducing_gap=gap)
        return picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else picture

    if item.clip:  # each frame fitted as it is decoded
        fitted = clips.load_clip(item.path, fps=item.fps, frames=item.frames, fit=fit)
    else:
        with Image.open(item.path) as raw:
            fitted = [fit(_to_rgb(ImageOps.exif_transpose(raw)))]
    arrays = [np.asarray(frame, dtype=np.float32) for frame in fitted]
    # (C, H, W); a clip bucket's (F, H, W, C) -> (C, F, H, W)
    clip = len(bucket_size) == 3
    pixels = np.stack(arrays).transpose(3, 0, 1, 2) if clip else arrays[0].transpose(2, 0, 1)
    pixels = pixels / 127.5 - 1.0
    mask = None
    if item.mask is not None:
        with Image.open(item.mask) as raw:
            grey = ImageOps.exif_transpose(raw).convert("L")
        mask = np.asarray(fit(grey, Image.Resampling.BOX), dtype=np.float32)[None] / 255.0
    return Example(
        pixels=np.ascontiguousarray(pixels),
        caption=item.caption,
        original_size=(h, w),
        crop_top_left=(top, nw - left - bw if flip else left),  # in the mirrored image
        target_size=(bh, bw),
        mask=mask,
    )


def _to_rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels become white (not black); 16-bit images are scaled, not clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        array = np.asarray(image, dtype=np.float32) / 257.0
        image = Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# --- batch order --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """Where training stands in the data: global batches consumed in this epoch.

    Counted in the world-size-independent global order, so a run can resume on another
    number of ranks (rounded up to the next full round of world_size batches).
    """

    epoch: int = 0
    batch: int = 0


def epoch_batches(
    buckets: dict[Size, list[int]], *, micro_batch: int, seed: int, epoch: int
) -> list[list[int]]:
    """The global batch order of one epoch: every batch from one bucket, every batch full."""
    rng = np.random.default_rng([seed, epoch])
    out: list[list[int]] = []
    for size in sorted(buckets):
        indices = [int(i) for i in rng.permutation(buckets[size])]
        for start in range(0, len(indices), micro_batch):
            batch = indices[start : start + micro_batch]
            # Top a short last batch up from the same bucket: fixed shapes, no image dropped.
            batch += [indices[j % len(indices)] for j in range(micro_batch - len(batch))]
            out.append(batch)
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def batches(
    dataset: Dataset,
    buckets: dict[Size, list[int]],
    *,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
) -> list[list[int]]:
    """This rank's micro-batches for one epoch; every rank gets the same number of them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if micro_batch < 1:
        raise ConfigError(f"ZT_TRAIN_BATCH_SIZE={micro_batch}: must be at least 1")
    if any(i >= len(dataset) for v in buckets.values() for i in v):
        raise ValueError("buckets index more items than the dataset holds")
    order = epoch_batches(buckets, micro_batch=micro_batch, seed=seed, epoch=epoch)
    per_rank = -(-len(order) // world_size)
    # Wrap around to the epoch's first batches so every rank gets the same count.
    order = [order[i % len(order)] for i in range(per_rank * world_size)]
    return order[rank::world_size]


def batches_per_epoch(buckets: dict[Size, list[int]], *, micro_batch: int, world_size: int) -> int:
    """Micro-batches each rank runs per epoch (what `batches` returns the length of)."""
    total = sum(-(-len(v) // micro_batch) for v in buckets.values())
    return -(-total // world_size)


def iterate_batches(
    dataset: Dataset,
    buckets: dict[Size, list[int]],
    *,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    start: Position = Position(),
) -> Iterator[tuple[list[int], Position]]:
    """Endless (indices, position after this batch) pairs; save the position, resume from it."""
    epoch, consumed = start.epoch, start.batch
    while True:
        mine = batches(
            dataset,
            buckets,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            seed=seed,
            epoch=epoch,
        )
        for local in range(-(-consumed // world_size), len(mine)):
            yield mine[local], Position(epoch, (local + 1) * world_size)
        epoch, consumed = epoch + 1, 0
