"""Which files under a data folder are read, and how each is opened.

A data folder is untrusted: often a mount, sometimes full of links, FIFOs and loops. `walk`
keeps the regular files inside it and says why it left out the rest; `open_regular` refuses a
file swapped for something else since. A loss mask is named after its picture: `foo.mask.png`
for `foo.jpg` (`masked`); so is a control image, an edit model's input: `foo.control.png`, then
`foo.control_1.png`, ... for several (`controlled`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
MASK_SUFFIX = ".mask"  # foo.mask.png weights the loss of foo.png / foo.jpg
# /data is often a mount: a link leading out of it reads files the user did not mean to train on.
LINK_OUT = "links outside the data folder"
# foo.control.png (the first), foo.control_1.png, ...: foo's control images, in that order
CONTROL_NAME = re.compile(r"^(?P<picture>.+)\.control(?:_(?P<index>\d{1,4}))?$")


def walk(root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
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
            elif masked(path) is not None or controlled(path) is not None:
                # `foo.mask.png/`, `foo.control.png/`: their picture is left out
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


def masked(path: Path) -> Path | None:
    """The picture a mask's name stands for (`a/foo` for `a/foo.mask.png`); None for any
    other name."""
    if path.suffix.lower() in IMAGE_SUFFIXES and path.stem.endswith(MASK_SUFFIX):
        return path.with_name(path.stem.removesuffix(MASK_SUFFIX))
    return None


def controlled(path: Path) -> tuple[Path, int] | None:
    """The picture a control image's name stands for and its place among that picture's
    controls (`(a/foo, 0)` for `a/foo.control.png`, `(a/foo, 2)` for `a/foo.control_2.png`);
    None for any other name."""
    if path.suffix.lower() not in IMAGE_SUFFIXES or not (match := CONTROL_NAME.match(path.stem)):
        return None
    return path.with_name(match["picture"]), int(match["index"] or 0)


def _inode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


@contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO]:
    """A binary reader of a regular file. O_NONBLOCK: a file swapped for a FIFO since the
    walk fails here instead of blocking the scan."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        yield reader
