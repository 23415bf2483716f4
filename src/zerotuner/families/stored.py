"""Parameter counts read from a local model's safetensors headers.

A safetensors file opens with a header naming every tensor's shape, so a folder's parameters
are counted without importing diffusers or transformers and without building the model on
the meta device (seconds): the entrypoint plans in a fraction of that, and its CPU goes to the
ranks starting beside it (`launch.start_ranks`). A folder without safetensors weights under
the libraries' own file names returns None and is counted on the meta device instead.

A file holds persistent buffers too: used for the UNets and the frozen parts, which have none,
not for SD3's transformer (its positional embedding is one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zerotuner.settings.files import load_mapping

DIFFUSERS_STEM = "diffusion_pytorch_model"
STEMS = (DIFFUSERS_STEM, "model")  # diffusers' and transformers' weight files


def stored_counts(folder: Path) -> tuple[int, int] | None:
    """(parameters, largest tensor's elements) of the weights in `folder`, or None."""
    from safetensors import safe_open

    files = weight_files(folder)
    if not files:
        return None
    sizes = []
    for path in files:
        with safe_open(str(path), framework="numpy") as weights:
            sizes += [math.prod(weights.get_slice(k).get_shape()) for k in weights.keys()]  # noqa: SIM118 - safe_open is no dict
    return (sum(sizes), max(sizes)) if sizes else None


def model_json(path: Path) -> dict[str, Any]:
    """A JSON file of the model's folder (an index, a config), read through the user-file
    reader: a broken, huge or special file is one line naming ZT_MODEL, not a traceback."""
    return load_mapping(path, setting="ZT_MODEL")


def weight_files(folder: Path, stems: tuple[str, ...] = STEMS) -> list[Path] | None:
    """The safetensors files `from_pretrained` loads from `folder` without a variant: one
    file, or the shards its index names; None when it has none (or an index's shard is
    missing). A folder with both: diffusers takes the index, transformers the single file."""
    for stem in stems:
        single = folder / f"{stem}.safetensors"
        index = folder / f"{stem}.safetensors.index.json"
        if single.is_file() and not (stem == DIFFUSERS_STEM and index.is_file()):
            return [single]
        if index.is_file():
            names = sorted(set(model_json(index)["weight_map"].values()))
            files = [folder / name for name in names]
            return files if all(f.is_file() for f in files) else None
    return None


def stored_config(folder: Path, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The folder's config.json when it has `keys` (save_pretrained writes them all)."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = model_json(path)
    return config if all(k in config for k in keys) else None


def unet_config_path(model_dir: Path, denoiser: str | None = None) -> Path | None:
    """The trained model's config: the UNet's, or a transformer family's transformer's (or
    the `denoiser` folder's: Wan 2.2 A14B's chosen expert, `transformer_2`)."""
    parts = (denoiser,) if denoiser else ("unet", "transformer")
    candidates = [model_dir / part / "config.json" for part in parts]
    for candidate in (*candidates, model_dir / "config.json"):
        if candidate.is_file():
            return candidate
    return None
