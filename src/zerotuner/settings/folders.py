"""The job's folders: they must not overlap the training data, and the ones a run writes must
be writable folders.

The dataset is every image under ZT_DATA_DIR, found again at each start: an output folder
inside it makes a run's own samples and loss curve the next run's training data, a cache or
offload folder inside it fills it with latents and swap files, and a data folder inside the
output or offload folder sits where checkpoint rotation and swap cleanup delete. So these are
refused before anything is created, cleaned or mounted (exit 2), one line per overlap.
Paths are compared as the OS resolves them: `~`, relative parts and symlinks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.settings.datasets import sources
from zerotuner.settings.schema import Settings, env_name

# (folder, what goes wrong when it is the data folder or inside it)
INSIDE_DATA = {
    "output_dir": "the run's samples and loss curve would become training data",
    "cache_dir": "the model downloads and latent cache would be scanned as training data",
    "offload_dir": "NVMe swap files would be written among the training data",
}
# (folder, what goes wrong when the data folder is inside it)
HOLDS_NO_DATA = {
    "output_dir": "checkpoints, samples and the export are written and rotated there",
    "offload_dir": "stale swap files are deleted there before each launch",
}


def resolved(path: Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def overlaps(settings: Settings) -> list[str]:
    """One line per folder that overlaps a local dataset (ZT_DATA_DIR or an entry of
    ZT_DATASETS_FILE), naming both settings and paths. Reading the datasets file here makes a
    bad entry one line (exit 2) before anything else reads it."""
    problems = []
    for source in sources(settings):
        if source.location.remote:  # its copy lives in the cache, which holds no user data
            continue
        data = resolved(Path(source.path))
        named = (
            f"{env_name('data_dir')}={_shown(Path(source.path))}"
            if settings.datasets_file is None
            else f"the dataset {_shown(Path(source.path))} of {env_name('datasets_file')}"
        )
        for name in ("output_dir", "cache_dir", "offload_dir"):
            folder = getattr(settings, name)
            path = resolved(folder)
            if path == data or path.is_relative_to(data):
                where = "is" if path == data else "is inside"
                why = INSIDE_DATA[name]
            elif name in HOLDS_NO_DATA and data.is_relative_to(path):
                where, why = "holds", HOLDS_NO_DATA[name]
            else:
                continue
            problems.append(
                f"{env_name(name)}={_shown(folder)} {where} {named}: {why}; give each its own "
                "folder"
            )
    return problems


def refuse_overlaps(settings: Settings) -> str:
    """Raise ConfigError (exit 2) when a folder overlaps the data; else describe them."""
    problems = overlaps(settings)
    if problems:
        raise ConfigError(problems[0], problems=problems)
    return "data, output, cache and offload folders do not overlap"


# The folders a run writes to (the offload folder is checked where NVMe offload prepares it).
WRITTEN = ("output_dir", "cache_dir")


def writable(path: Path, setting: str) -> str:
    """Raise EnvironmentUnfit (exit 3) unless files can be created in `path`, or in its nearest
    existing parent when it is still to be created; else describe it. `check` and `train` both
    call this before any rank starts, so a read-only mount fails in a second, not after
    loading."""
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        raise EnvironmentUnfit(
            f"{setting}={path}: {existing} is a file, not a folder; point {setting} at a folder "
            "(or mount a volume there)"
        )
    try:  # a file that vanishes on close: the only test root cannot fool (root ignores modes)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise EnvironmentUnfit(
            f"{setting}={path} is not writable ({exc.strerror} in {existing}): mount a "
            "read-write volume there"
        ) from None
    return f"{path} writable" + ("" if existing == path else " (will be created)")


def require_writable(settings: Settings) -> list[str]:
    """`writable` for every folder a run writes; one description each."""
    return [writable(getattr(settings, name), env_name(name)) for name in WRITTEN]


def _shown(path: Path) -> str:
    """The path as the user wrote it, and where it leads when that differs."""
    real = resolved(path)
    return str(path) if str(real) == str(path) else f"{path} (-> {real})"


def readable_by_all(folder: Path) -> Path:
    """Give every file and folder under `folder` the read (and folder search) bits the umask
    allows. safetensors writes its files 0600, so an export or a demo model written as one
    user (root on the host, uid 1000 in the image) could not be read as another: the container
    that mounts it, the colleague who loads it."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (folder, *folder.rglob("*")):
        if path.is_symlink():
            continue
        extra = (0o555 if path.is_dir() else 0o444) & ~umask
        mode = path.stat().st_mode & 0o7777
        if mode | extra != mode:
            path.chmod(mode | extra)
    return folder


def unreadable_file(folder: Path) -> Path | None:
    """The first file under `folder` (links followed, as the hub cache's are) this process
    cannot read, else None. Root reads everything: this matters for the image's uid 1000."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not os.access(path, os.R_OK):
            return path
    return None
