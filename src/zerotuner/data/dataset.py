"""What a scan found: the usable images and clips (`Item`), the files left out, and for several
datasets (ZT_DATASETS_FILE) each one's `Part`; with the few lines a user reads about them.

The latent cache (in the training worker) keys entries on what `scan` records per file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerotuner.data import clips
from zerotuner.data.captions import CAPTION_BYTES

Size = tuple[int, int]  # (width, height) in pixels
SUMMARY_EXAMPLES = 3  # paths named per kind of skipped file
SUMMARY_KINDS = 8  # kinds of skipped file listed, one line each


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
    start: int = 0  # a clip's window: its first sampled frame (ZT_VIDEO_WINDOWS)
    # an edit model's input images (foo.control.png, ...), cropped and flipped with this one
    controls: tuple[Path, ...] = ()
    control_digests: tuple[str, ...] = ()

    @property
    def content(self) -> str:
        """What the cached latents depend on besides the bucket: the image, its mask and its
        control images, or the clip, the rate its frames are sampled at and its window."""
        if self.fps:
            window = f"+{self.start}" if self.start else ""  # the head's key as before windows
            return f"{self.digest}@{self.fps:g}fps{window}"
        image = f"{self.digest}+{self.mask_digest}" if self.mask else self.digest
        return f"{image}|{','.join(self.control_digests)}" if self.controls else image

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
                f"{count(len(self.cut_captions), 'caption')} longer than "
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
    """`12 images`, `12 images with their control images`, or with clips `10 images and 4
    clips (2.5 s)`: the seconds they train; `... and 4 clips in 12 windows (30.0 s)` when
    clips are cut into windows (seconds that overlapping windows share count once)."""
    windows = [item for item in items if item.clip]
    images = count(len(items) - len(windows), "image")
    if items and items[0].controls:  # an edit family's: every item has as many
        images += f" with {count(len(items[0].controls), 'control image')} each"
    if not windows:
        return images
    spans: dict[Path, set[int]] = {}  # each clip's sampled intervals its windows train
    rates: dict[Path, float] = {}
    for item in windows:
        spans.setdefault(item.path, set()).update(range(item.start, item.start + item.frames - 1))
        rates[item.path] = item.fps
    seconds = sum(len(spans[path]) / rates[path] for path in spans if rates[path])
    cut = f" in {count(len(windows), 'window')}" if len(windows) > len(spans) else ""
    return f"{images} and {count(len(spans), 'clip')}{cut} ({seconds:.1f} s)"


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
        lines.append(f"skipped {count(len(entries), 'file')}, {kind}: {_examples(names)}")
    if len(kinds) > SUMMARY_KINDS:
        rest = sorted(kinds.items(), key=lambda k: -len(k[1]))[SUMMARY_KINDS:]
        lines.append(
            f"skipped {count(sum(len(e) for _, e in rest), 'more file')} of {len(rest)} other kinds"
        )
    return lines


def count(n: int, noun: str) -> str:
    """`1 image`, `2 images`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _examples(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SUMMARY_EXAMPLES])
    more = len(names) - SUMMARY_EXAMPLES
    return shown + (f" and {more} more" if more > 0 else "")
