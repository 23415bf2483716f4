"""Where NVMe swap goes: one offload folder for the whole job, decided before anything uses it.

Two places can name it: `ZT_OFFLOAD_DIR`, and the `nvme_path` of a DeepSpeed JSON or an
accelerate file. A real `nvme_path` is the user's choice and wins over the setting's default:
it becomes the offload dir that `check` and `train` validate, clean and size, the planner
measures, the metrics watch and the ranks write. An explicit `ZT_OFFLOAD_DIR` naming another
folder is a contradiction (exit 2): guessing would put swap where one of them did not expect.
The seed's literal placeholders (`/path/to/nvme`, `/local_nvme`) are no choice at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.settings.notes import Notes
from zerotuner.settings.schema import Settings, env_name

NVME_PLACEHOLDERS = ("", "none", "null", "auto", "/path/to", "/local_nvme", "/nvme")
SECTIONS = ("offload_optimizer", "offload_param")


def is_placeholder(value: Any) -> bool:
    text = str(value).strip() if value is not None else ""
    return text.lower() in NVME_PLACEHOLDERS or text.startswith("/path/to")


def same_folder(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Equal once `~`, relative parts and symlinks are resolved (the folders need not exist)."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


@dataclass(frozen=True)
class NvmePath:
    path: Path  # absolute
    where: str  # e.g. "zero_optimization.offload_param.nvme_path in ZT_DEEPSPEED_CONFIG=ds.json"


def user_nvme_path(layers: list[tuple[dict[str, Any], str]]) -> NvmePath | None:
    """The real `nvme_path` the user's files name, if any (placeholders name none).

    `layers`: each input's DeepSpeed dict with how to name its nvme_path key in a message (a
    template with `{key}`), lowest precedence first, as inputs.py merges them. zerotuner
    prepares one offload volume, so two different real paths are refused rather than half
    honoured (DeepSpeed would use both; the checks, the cleanup and the metrics see one)."""
    found: dict[str, NvmePath] = {}
    for deepspeed, name in layers:
        zero = deepspeed.get("zero_optimization")
        for key in SECTIONS if isinstance(zero, dict) else ():
            section = zero.get(key)  # type: ignore[union-attr]
            if not isinstance(section, dict) or "nvme_path" not in section:
                continue
            value, where = section["nvme_path"], name.replace("{key}", key)
            found.pop(key, None)  # this layer's value replaces a lower one's, placeholder or not
            if value is None or is_placeholder(value):
                continue
            if not isinstance(value, str) or "\x00" in value:
                raise ConfigError(f"{where}={value!r}: expected a folder path")
            found[key] = NvmePath(Path(value.strip()).expanduser().absolute(), where)
    paths = list(found.values())
    if len(paths) == 2 and not same_folder(paths[0].path, paths[1].path):
        (a, b), setting = paths, env_name("offload_dir")
        raise ConfigError(
            f"{a.where} is {a.path} but {b.where} is {b.path}: zerotuner prepares one NVMe "
            f"offload folder; give both the same path (or drop both and set {setting})"
        )
    return paths[0] if paths else None


def conflict(offload_dir: Path, nvme: NvmePath) -> str:
    setting = env_name("offload_dir")
    return (
        f"{setting}={offload_dir} and {nvme.where} ({nvme.path}) name different NVMe offload "
        f"folders: unset {setting}, or set it and nvme_path to the same folder"
    )


def resolve_offload_dir(settings: Settings, nvme: NvmePath | None, notes: Notes) -> Settings:
    """The settings with the job's one offload dir: the user's nvme_path when the setting was
    left at its default. Raises ConfigError when both are explicit and differ."""
    if nvme is None:
        return settings
    if "offload_dir" in settings.model_fields_set:
        if same_folder(settings.offload_dir, nvme.path):
            return settings
        raise ConfigError(conflict(settings.offload_dir, nvme))
    notes.info(f"{env_name('offload_dir')}={nvme.path} from {nvme.where}")
    return settings.model_copy(update={"offload_dir": nvme.path})
