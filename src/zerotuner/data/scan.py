"""Finding a run's data: every usable image under each dataset's folder (and clip, for a video
family), with its caption and loss mask, joined into one Dataset.

Every rank scans the same folders and gets the same answer, so ranks agree on the data
without talking. Several datasets (ZT_DATASETS_FILE) are scanned one by one (`scan_sources`)
and joined into one Dataset whose `parts` keep each one's repeats and resolution. A loss mask
is an image beside its picture, `foo.mask.png` for `foo.jpg`: white trains, black is left out
(`Item.mask`). An edit model trains on control images beside their target, `foo.control.png`
(then `foo.control_1.png`, ...), named in metadata.jsonl's `control` column, or in a dataset's
`control_dir` under the target's own name (`controls.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from zerotuner.data import clips, controls
from zerotuner.data.captions import METADATA_FILE, apply_template, read_caption, read_metadata
from zerotuner.data.dataset import Dataset, Item, Part
from zerotuner.data.files import IMAGE_SUFFIXES, controlled, masked, walk
from zerotuner.data.probe import Probe, index_path, probe_files
from zerotuner.errors import ConfigError
from zerotuner.settings.datasets import DatasetSource, local_folder

log = logging.getLogger(__name__)

COMPANION_SUFFIXES = {".txt", ".jsonl", ".json", ".md", ".yaml", ".yml", ".toml"}
SMALL = "smaller than ZT_MIN_IMAGE_SIZE"  # the skip reason of an image below it
FETCHED = ".zerotuner-fetched"  # in a remote dataset's copy once every file is in place


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
    video: clips.Video | None = None,
    control_count: int | range = 0,
    control_dir: Path | None = None,
    control_index: Path | None = None,
) -> Dataset:
    """Find every readable PNG/JPEG/WebP under data_dir (recursively), with its caption.

    Each image is fully decoded once, so a truncated file is found here, not mid-training.
    With `index` (a JSON file outside the possibly read-only data dir) the results are
    remembered by (path, size, mtime) and a restart decodes only new or changed files; let one
    rank write it (`write_index`). Files that fail are skipped with one warning each (set
    log_skipped=False on all ranks but one) and listed in `Dataset.skipped`, as are images
    whose short side is below `min_image_size` (ZT_MIN_IMAGE_SIZE). Each caption goes through
    `caption_template` (ZT_CAPTION_TEMPLATE), so the text cache holds what is trained on.
    Captions are read from `caption_extension` sidecars; `foo.mask.png` is foo's loss mask.
    `control_count`: the control images an edit family trains each target with, or the range
    of counts it takes (Spec.control_counts; 0: control images are refused, `controls.refuse`;
    the items' counts may differ here: `scan_sources` refuses a mix; more than a range's most
    is refused, `controls.too_many`); they are found beside their targets, in metadata.jsonl
    or in `control_dir` (its scan index: `control_index`), and a target without them usable
    is skipped. No usable image is a ConfigError (exit 2) naming `setting`.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ConfigError(
            f"{setting}={data_dir}: no such directory; mount a folder of PNG, JPEG or WebP "
            "images (captions in sidecar .txt files or metadata.jsonl) there"
        )
    files, skipped = walk(data_dir)
    metadata, named_controls = read_metadata([p for p in files if p.name == METADATA_FILE])
    sidecars = {p for p in files if p.suffix == caption_extension}
    found = controls.find(data_dir, files, skipped, named_controls, control_dir)
    # controls are no targets (a metadata row's or control_dir's may have any name)
    others = [p for p in files if p.resolve() not in found.files] if found.files else files
    candidates, masks = _classify(others, sidecars, skipped, video)
    paired, broken_masks = _pair_masks(candidates, masks, skipped)
    attached = found.attach(candidates, skipped)
    if isinstance(control_count, int):
        control_count = range(control_count, control_count + 1) if control_count else range(0)
    if not control_count and (attached or control_dir):
        raise controls.refuse(setting, data_dir, attached)
    mask_files = [m for m in paired.values() if m is not None]
    probes = probe_files(
        data_dir, candidates + mask_files + found.inside, video=video, index=index,
        write_index=write_index, workers=workers,
    )  # fmt: skip
    masks_end = len(candidates) + len(mask_files)
    mask_probes = dict(zip(mask_files, probes[len(candidates) : masks_end], strict=True))
    control_probes = dict(zip(found.inside, probes[masks_end:], strict=True))
    if control_dir is not None and found.outside:
        outside = probe_files(
            control_dir, found.outside, video=None, index=control_index,
            write_index=write_index, workers=workers,
        )  # fmt: skip
        control_probes.update(zip(found.outside, outside, strict=True))
    items, cut = [], []
    for path, probe in zip(candidates, probes[: len(candidates)], strict=True):
        mask = paired[path]
        mask_probe = mask_probes[mask] if mask else None
        why = _left_out(probe, mask_probe, broken_masks.get(path), min_image_size)
        own = attached.get(path, [])
        if len(control_count) > 1 and len(own) > control_count[-1]:
            raise controls.too_many(setting, path, len(own), control_count)
        why = why or found.left_out(path, probe, [control_probes.get(c) for c in own],
                                    control_count)  # fmt: skip
        if why:
            skipped.append((path, why))
            continue
        caption, cut_at = read_caption(
            path, data_dir, sidecars, metadata, skipped, caption_extension
        )
        if cut_at:
            cut.append(cut_at)
        if caption_template is not None:
            caption = apply_template(caption_template, caption)
        item = _item(path, data_dir, caption, probe, mask, mask_probe, video)
        if own:
            digests = tuple(control_probes[c].digest for c in own)
            item = replace(item, controls=tuple(own), control_digests=digests)
        items += _windows(item, probe, video)
    skipped.sort()
    dataset = Dataset(data_dir, tuple(items), tuple(skipped), tuple(sorted(cut)))
    if not items:
        raise _nothing_usable(dataset)
    if log_skipped:
        _warn(dataset)
    return dataset


def _classify(
    files: list[Path],
    sidecars: set[Path],
    skipped: list[tuple[Path, str]],
    video: clips.Video | None,
) -> tuple[list[Path], dict[Path, Path]]:
    """The pictures to probe (and clips, for a video family), and the masks by the picture
    their name stands for; any other file but a caption or a companion joins `skipped`."""
    candidates: list[Path] = []
    masks: dict[Path, Path] = {}
    for path in files:
        suffix = path.suffix.lower()
        if (picture := masked(path)) is not None:
            masks[picture] = path
        elif suffix in IMAGE_SUFFIXES or (video and suffix in clips.CLIP_SUFFIXES):
            candidates.append(path)
        elif suffix in clips.CLIP_SUFFIXES:
            skipped.append((path, "video clips (ZT_MODEL is an image model: they train video "
                                  "families such as Wan)"))  # fmt: skip
        elif suffix not in COMPANION_SUFFIXES and path not in sidecars:
            kind = f"'{suffix}' files" if suffix else "files without a suffix"
            skipped.append((path, f"{kind} are not read (PNG, JPEG or WebP are)"))
    return candidates, masks


def _pair_masks(
    candidates: list[Path], masks: dict[Path, Path], skipped: list[tuple[Path, str]]
) -> tuple[dict[Path, Path | None], dict[Path, str]]:
    """Each candidate's mask (None: it has none), and why for a picture whose mask the walk
    left out. A mask without its picture joins `skipped`."""
    paired = {
        path: masks.pop(path.with_suffix(""), None) if path.suffix.lower() in IMAGE_SUFFIXES
        else None
        for path in candidates
    }  # fmt: skip
    # A mask the walk left out (a FIFO, a link out, a dangling link, a folder) still says
    # which part of its picture must not train: the picture is left out with it.
    unusable = {picture: why for path, why in skipped if (picture := masked(path)) is not None}
    broken = {
        path: unusable[path.with_suffix("")]
        for path, mask in paired.items()
        if mask is None and path.suffix.lower() in IMAGE_SUFFIXES
        and path.with_suffix("") in unusable
    }  # fmt: skip
    skipped += [(mask, "masks without an image of the same name") for mask in masks.values()]
    return paired, broken


def _left_out(
    probe: Probe, mask_probe: Probe | None, broken_mask: str | None, min_image_size: int
) -> str | None:
    """Why a probed picture does not train (its skip reason), or None when it does."""
    if probe.size is None:
        return probe.reason
    if min(probe.size) < min_image_size:
        w, h = probe.size
        return f"{SMALL}={min_image_size} px on the short side ({w}x{h})"
    if mask_probe is not None and mask_probe.size is None:
        return f"its mask is unusable ({mask_probe.reason})"
    if broken_mask:
        return f"its mask is unusable ({broken_mask})"
    return None


def _item(
    path: Path,
    root: Path,
    caption: str,
    probe: Probe,
    mask: Path | None,
    mask_probe: Probe | None,
    video: clips.Video | None,
) -> Item:
    assert probe.size is not None  # a probe without a size says why, and is left out
    return Item(
        path, caption, probe.size, probe.file_size, probe.mtime_ns, probe.digest,
        name=path.relative_to(root).as_posix(), mask=mask,
        mask_digest=mask_probe.digest if mask_probe else "", frames=probe.frames,
        fps=video.fps if video and path.suffix.lower() in clips.CLIP_SUFFIXES else 0.0,
    )  # fmt: skip


def _windows(item: Item, probe: Probe, video: clips.Video | None) -> list[Item]:
    """A clip's windows (ZT_VIDEO_WINDOWS), each an item of its own; an image, or a clip
    trained from its start alone, as it is. A window after the first is named `clip.mp4#N`
    (N: its first sampled frame), so each has its own latents in the cache."""
    if not item.clip or video is None:
        return [item]
    starts = video.windows.starts(probe.available, item.frames)
    return [replace(item, start=s, name=f"{item.name}#{s}" if s else item.name) for s in starts]


def _nothing_usable(dataset: Dataset) -> ConfigError:
    found = f"; {len(dataset.skipped)} file(s) skipped, listed below" if dataset.skipped else ""
    return ConfigError(
        "",
        problems=[
            f"ZT_DATA_DIR={dataset.root}: no usable images{found}; expected PNG, JPEG or WebP "
            "files (searched recursively) with captions in sidecar .txt files or "
            "metadata.jsonl",
            *dataset.warnings(),
        ],
    )


def _warn(dataset: Dataset) -> None:
    """The dataset's warnings in the log, one line each (a few however many files)."""
    for line in dataset.warnings():
        log.warning("%s", line)


def scan_sources(
    sources: Sequence[DatasetSource],
    cache_dir: Path,
    *,
    log_skipped: bool = True,
    write_index: bool = True,
    min_image_size: int = 0,
    video: clips.Video | None = None,
    datasets_file: Path | None = None,
    control_count: int | range = 0,
    setting: str = "ZT_DATA_DIR",
) -> Dataset:
    """Every dataset of the run scanned (`scan`) and joined: one dataset as it is, several
    into a Dataset whose `parts` keep each one's repeats and resolution. A remote dataset is
    read from its fetched copy (settings.datasets.local_folder); `preflight.fetch` made it.
    `datasets_file` (ZT_DATASETS_FILE): what an error names instead of ZT_DATA_DIR.
    `control_count`: the control images the model's family trains each target with, or the
    range it takes (Spec.control_counts; 0: a text-to-image family; a `control_dir` or control
    images are refused in one line); the items of all datasets must have one count
    (controls.one_count; `setting` names them there: ZT_EVAL_DATA_DIR's). A
    dataset's `video_windows` cuts its clips instead of `video`'s (ZT_VIDEO_WINDOWS)."""
    scanned = []
    for number, source in enumerate(sources):
        sampling = replace(video, windows=source.windows) if video and source.windows else video
        control_dir = controls.control_folder(source, number, datasets_file, control_count)
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
                index=index_path(cache_dir, folder),
                video=sampling,
                control_count=control_count,
                control_dir=control_dir,
                control_index=index_path(cache_dir, control_dir) if control_dir else None,
            )  # fmt: skip
        )
    if len(scanned) == 1 and sources[0].repeats == 1 and sources[0].resolution is None:
        dataset = scanned[0]
    else:
        parts: list[Part] = []
        items: list[Item] = []
        start = 0
        for source, part in zip(sources, scanned, strict=True):
            parts.append(Part(source.path, part, start, source.repeats, source.resolution))
            items += part.items
            start += len(part)
        skipped = tuple(s for part in scanned for s in part.skipped)
        cut = tuple(c for part in scanned for c in part.cut_captions)
        dataset = Dataset(scanned[0].root, tuple(items), skipped, cut, tuple(parts))
    named = f"ZT_DATASETS_FILE={datasets_file}" if datasets_file else setting
    controls.one_count(named, dataset.items)
    if log_skipped:
        _warn(dataset)
    return dataset


def listed_samples(
    sources: Sequence[DatasetSource], cache_dir: Path, *, video: bool = False
) -> int | None:
    """Samples an epoch as the file names tell, nothing decoded (`plan`; `check` scans): each
    dataset's pictures (and clips for a video family) times its repeats. None while a dataset
    is not there, or not fetched yet."""
    suffixes = IMAGE_SUFFIXES + (clips.CLIP_SUFFIXES if video else ())
    total = 0
    for source in sources:
        if (walked := _walked(source, cache_dir)) is None:
            return None
        _, files, _ = walked
        pictures = [p for p in files if p.suffix.lower() in suffixes and masked(p) is None
                    and controlled(p) is None]  # fmt: skip
        total += len(pictures) * source.repeats
    return total


def listed_references(sources: Sequence[DatasetSource], cache_dir: Path) -> int | None:
    """The most control images a target has as the file names tell, nothing decoded (beside
    it, in metadata.jsonl, in `control_dir`): what the planner counts a family whose references
    are optional (FLUX.2) with; `scan` pairs them. None while a dataset is not there, or not
    fetched yet."""
    most = 0
    for source in sources:
        if (walked := _walked(source, cache_dir)) is None:
            return None
        folder, files, skipped = walked
        _, named = read_metadata([p for p in files if p.name == METADATA_FILE])
        given = Path(source.control_dir).expanduser() if source.control_dir else None
        control_dir = given if given and given.is_dir() else None  # (the scan refuses it)
        found = controls.find(folder, files, skipped, named, control_dir)
        counts = [len(own) for own in found.named.values()]
        counts += [len(places) for places in found.beside.values()]
        most = max([most, *counts])
    return most


def _walked(
    source: DatasetSource, cache_dir: Path
) -> tuple[Path, list[Path], list[tuple[Path, str]]] | None:
    """A dataset's folder and its walk (files, skipped), nothing decoded; None while it is not
    there, or not fetched yet."""
    folder = local_folder(source, cache_dir)
    if not folder.is_dir() or (source.location.remote and not (folder / FETCHED).is_file()):
        return None
    files, skipped = walk(folder)
    return folder, files, skipped
