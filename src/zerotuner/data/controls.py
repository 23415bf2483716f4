"""Control images: an edit model's inputs, each paired with the target image it learns to make
from them (FLUX.1 Kontext's reference image).

A target's controls are found, in this order of precedence:
- in a metadata.jsonl row: `control` (a name or a list of names), then `control_1`, ...,
  relative to the metadata file's folder (inside the data folder or the dataset's
  `control_dir`);
- beside it, named after it: `foo.control.png` (the first), `foo.control_1.png`, ... for
  `foo.jpg` (any image suffix);
- in the dataset's `control_dir` (ZT_DATASETS_FILE), under the target's own relative name:
  `sub/foo.png` (or `sub/foo.control.png`), then `sub/foo.control_1.png`, ...

A control is probed as a target is (data.probe: unreadable, truncated, bombed, a FIFO, a link
out of the folder); a target whose controls are missing, unusable, too few or too many for
the model, or of another aspect ratio (they are cropped with the target's box) is skipped
with why. A text-to-image family refuses control images in one line (`refuse`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerotuner.data.dataset import Item, count
from zerotuner.data.files import IMAGE_SUFFIXES, LINK_OUT, controlled, walk
from zerotuner.data.probe import Probe
from zerotuner.errors import ConfigError
from zerotuner.settings.datasets import DatasetSource

# A control is cropped with its target's box, scaled to its own size: an aspect ratio that
# differs by more than this (about 2 %, beyond rounding a resized copy) crops other content.
ASPECT_TOLERANCE = 0.02
NO_PICTURE = "control images without an image of the same name"


def edit_families() -> list[str]:
    """The families that train on control images (their Spec's `controls`)."""
    from zerotuner.families.registry import REGISTRY

    return [name for name, spec in REGISTRY.items() if spec.controls]


@dataclass
class Found:
    """Every control image of one dataset folder, before they are paired with targets."""

    beside: dict[Path, dict[int, Path]]  # a picture's path without suffix -> {place: control}
    named: dict[Path, list[Path]]  # metadata rows: the image's resolved path -> its controls
    unusable: dict[Path, str]  # a picture (without suffix or resolved) -> why a control is not
    files: set[Path]  # the resolved files that are controls: never targets themselves
    control_dir: Path | None = None
    inside: list[Path] = field(default_factory=list)  # paired controls under the data folder
    outside: list[Path] = field(default_factory=list)  # ... and under control_dir

    def attach(
        self, candidates: Sequence[Path], skipped: list[tuple[Path, str]]
    ) -> dict[Path, list[Path]]:
        """Each candidate picture's controls in order (pictures without any are left out of
        the answer); controls without a picture join `skipped`."""
        attached: dict[Path, list[Path]] = {}
        for path in candidates:
            if path.suffix.lower() not in IMAGE_SUFFIXES:  # a clip
                continue
            by_place = self.beside.pop(path.with_suffix(""), {})
            named = self.named.get(path.resolve())
            own = named if named is not None else [by_place[i] for i in sorted(by_place)]
            if own or self._why(path):
                attached[path] = own
        skipped += [(c, NO_PICTURE) for places in self.beside.values() for c in places.values()]
        paired = dict.fromkeys(c for own in attached.values() for c in own)
        unread = {c for path in attached if self._why(path) for c in attached[path]}
        under = self.control_dir
        self.outside = [c for c in paired if under and c.is_relative_to(under) and c not in unread]
        self.inside = [c for c in paired if c not in self.outside and c not in unread]
        return attached

    def _why(self, path: Path) -> str | None:
        """Why a picture's controls cannot be read, known before probing (a control the walk
        left out, a metadata row naming one outside the folders)."""
        return self.unusable.get(path.with_suffix("")) or self.unusable.get(path.resolve())

    def left_out(
        self, path: Path, probe: Probe, probes: Sequence[Probe | None], wanted: range
    ) -> str | None:
        """Why a probed picture does not train for its controls (its skip reason), or None.
        `wanted`: the counts the model takes (Spec.control_counts)."""
        if not wanted:
            return None
        if why := self._why(path):
            return f"its control image is unusable ({why})"
        if not probes:  # (a model whose control images are optional trains it without)
            return None if 0 in wanted else "without its control image"
        if len(probes) not in wanted:
            return f"with {count(len(probes), 'control image')} (the model takes {takes(wanted)})"
        assert probe.size is not None  # a picture without a size is left out before
        tw, th = probe.size
        for control in probes:
            if control is None or control.size is None:
                return f"its control image is unusable ({control.reason if control else '?'})"
            cw, ch = control.size
            if abs(math.log((cw / ch) / (tw / th))) > ASPECT_TOLERANCE:
                return (f"its control image's aspect ratio differs from its own (control "
                        f"{cw}x{ch}, image {tw}x{th})")  # fmt: skip
        return None


def find(
    data_dir: Path,
    files: list[Path],
    skipped: list[tuple[Path, str]],
    named: dict[Path, list[Path]],
    control_dir: Path | None,
) -> Found:
    """The control images of a data folder's walk (`files`, `skipped`), its metadata rows'
    (`named`) and `control_dir`'s; what `control_dir`'s walk leaves out joins `skipped`."""
    beside: dict[Path, dict[int, Path]] = {}
    unusable: dict[Path, str] = {}
    controls: set[Path] = set()
    for path in files:
        if (found := controlled(path)) is not None:
            beside.setdefault(found[0], {})[found[1]] = path
            controls.add(path.resolve())
    for path, why in skipped:  # a control the walk left out: its picture is left out with it
        if (found := controlled(path)) is not None:
            unusable[found[0]] = why
    if control_dir is not None:  # (inside the data folder, its files are no targets either)
        controls |= _control_folder(data_dir, control_dir, beside, unusable, skipped)
    roots = [data_dir] + ([control_dir] if control_dir else [])
    lexical: dict[Path, list[Path]] = {}
    for image, names in named.items():
        placed = [_under(name.resolve(), roots) for name in names]
        if any(p is None for p in placed):
            unusable[image] = LINK_OUT
        lexical[image] = [p or name for p, name in zip(placed, names, strict=True)]
        controls.update(p.resolve() for p in lexical[image])
    return Found(beside, lexical, unusable, controls, control_dir)


def _control_folder(
    data_dir: Path,
    control_dir: Path,
    beside: dict[Path, dict[int, Path]],
    unusable: dict[Path, str],
    skipped: list[tuple[Path, str]],
) -> set[Path]:
    """`control_dir`'s images by the picture they stand for: `sub/foo.png` or
    `sub/foo.control.png` is `data_dir/sub/foo`'s first, `sub/foo.control_1.png` its second;
    a control beside its picture takes precedence. Returns its files, resolved."""
    files, left_out = walk(control_dir)
    for path in files:
        relative = path.relative_to(control_dir)
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            skipped.append((path, "files in control_dir that are not PNG, JPEG or WebP images"))
            continue
        picture, place = controlled(relative) or (relative.with_suffix(""), 0)
        beside.setdefault(data_dir / picture, {}).setdefault(place, path)
    for path, why in left_out:
        skipped.append((path, why))
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_relative_to(control_dir):
            relative = path.relative_to(control_dir)
            picture, _ = controlled(relative) or (relative.with_suffix(""), 0)
            unusable[data_dir / picture] = why
    return {path.resolve() for path in files}


def _under(real: Path, roots: Sequence[Path]) -> Path | None:
    """A resolved path as seen under the first root that holds it, else None."""
    for root in roots:
        if real.is_relative_to(resolved := root.resolve()):
            return root / real.relative_to(resolved)
    return None


def takes(wanted: range) -> str:
    """The control image counts a model takes, in words: "1", "1 to 3"."""
    return str(wanted.start) if len(wanted) == 1 else f"{wanted.start} to {wanted[-1]}"


def too_many(setting: str, path: Path, found: int, wanted: range) -> ConfigError:
    """A target with more control images than a model that takes several reads (Qwen-Image-
    Edit Plus): one line (a model of one count skips such a target with why: `left_out`)."""
    return ConfigError(
        f"{setting}: {path} has {count(found, 'control image')}; the model takes "
        f"{takes(wanted)}: keep at most {wanted[-1]} per target"
    )


def one_count(setting: str, items: Sequence[Item], others: Sequence[Item] = ()) -> None:
    """Every item of a run trains with as many control images (a batch stacks them): mixed
    counts are one line naming each count and a file that has it. `others`: ZT_EVAL_DATA_DIR's
    items, which must have the training items' count."""
    example: dict[int, Path] = {}
    for item in items:
        example.setdefault(len(item.controls), item.path)
    if len(example) > 1:
        found = "; ".join(f"{count(n, 'control image')}: {example[n]}" for n in sorted(example))
        raise ConfigError(
            f"{setting}: targets with different numbers of control images ({found}); one run "
            "trains every target with as many (a batch stacks them): give each target the same "
            "number, or train each count in a run of its own"
        )
    held = {len(item.controls): item.path for item in others}
    if example and (differ := sorted(set(held) - set(example))):
        (trained, path), n = next(iter(example.items())), differ[0]
        raise ConfigError(
            f"ZT_EVAL_DATA_DIR: its targets have {count(n, 'control image')} ({held[n]}), the "
            f"training targets {trained} ({path}); held-out targets are evaluated as the "
            "training ones train: give them as many control images"
        )


def control_folder(
    source: DatasetSource, number: int, datasets_file: Path | None, wanted: range | int
) -> Path | None:
    """A datasets entry's `control_dir`, refused in one line when the model takes no control
    images or the folder is not there."""
    if source.control_dir is None:
        return None
    where = f"ZT_DATASETS_FILE={datasets_file}: datasets[{number}].control_dir={source.control_dir}"
    if not wanted:
        raise ConfigError(
            f"{where}: control images train an edit model ({', '.join(edit_families())}); "
            "this model's family takes none: drop control_dir, or set ZT_MODEL to an edit model"
        )
    folder = Path(source.control_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{where}: no such directory; point it at a folder of control images named as "
            "their targets (sub/foo.png for sub/foo.jpg; sub/foo.control_1.png for a second)"
        )
    return folder


def refuse(setting: str, root: Path, attached: dict[Path, list[Path]]) -> ConfigError:
    """Control images on a text-to-image family: one line naming a few and the edit families."""
    names = [c.relative_to(root).as_posix() if c.is_relative_to(root) else str(c)
             for own in attached.values() for c in own]  # fmt: skip
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ConfigError(
        f"{setting}={root}: control images ({shown}) train an edit model "
        f"({', '.join(edit_families())}); this model's family takes none: move them out of "
        "the data folder, or set ZT_MODEL to an edit model"
    )
