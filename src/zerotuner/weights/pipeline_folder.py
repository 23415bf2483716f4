"""A diffusers pipeline folder: which part is the denoiser, each part loaded (or built around
given weights, in fp32), and the folder written with trained weights in place of the base's.

A written folder is the base pipeline's frozen parts (VAE, text encoders, tokenizers,
scheduler, model_index.json) copied as they are, plus the trained parts written with
save_pretrained in safetensors (built on the meta device around the trained tensors: no random
init first). It is built next to the destination and renamed into place, so a reader never
sees half of one. Used for the run's final/, `zerotuner export`, a LoRA's merged/ and samples.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

from zerotuner.errors import ConfigError
from zerotuner.settings.folders import readable_by_all

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from transformers import PreTrainedModel

    # A pipeline part as load_part builds it: a diffusers model, or a transformers text encoder.
    Part: TypeAlias = ModelMixin | PreTrainedModel


def denoiser_part(base: Path) -> str:
    """The trained part of a pipeline folder: `unet`, or a transformer family's `transformer`."""
    index = json.loads((Path(base) / "model_index.json").read_text())
    return "unet" if "unet" in index else "transformer"


def load_part(base: Path, part: str, *, weights: bool = True) -> Part:
    """A pipeline part in fp32, of the class its model_index names (diffusers' or
    transformers'), with the base's weights or (`weights` False) freshly built."""
    import importlib

    library, name = json.loads((Path(base) / "model_index.json").read_text())[part]
    cls = getattr(importlib.import_module(library), name)
    if weights:
        return cls.from_pretrained(base, subfolder=part, dtype=torch.float32)
    if library == "diffusers":
        return cls.from_config(cls.load_config(Path(base) / part))
    import transformers

    return cls(transformers.AutoConfig.from_pretrained(Path(base) / part))


def built_part(base: Path, part: str, state: dict[str, torch.Tensor]) -> Part:
    """A part of `base`'s class holding `state` in fp32: built on the meta device and handed
    the tensors themselves, not randomly initialized first only to be overwritten (a second
    for a small UNet, minutes for a 12B transformer)."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on the meta device; buffers real
        module = load_part(base, part, weights=False)
    owned = {k: _whole(v.float() if v.is_floating_point() else v) for k, v in state.items()}
    missing, unexpected = module.load_state_dict(owned, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("position_ids")]  # a buffer, not saved
    if missing or unexpected:
        raise ConfigError(
            f"the trained weights do not match {base}/{part}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    # in inference mode, as from_pretrained leaves a part (HiDream's transformer answers in
    # patches in training mode)
    return module.eval()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it owns its whole storage, else a contiguous copy: a consolidated
    ZeRO state holds views of one flat buffer, which safetensors refuses to write."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def write_pipeline(
    base: Path,
    unet_state: dict[str, torch.Tensor],
    out: Path,
    *,
    text_states: dict[str, dict[str, torch.Tensor]] | None = None,
    denoiser: str | None = None,
    family: str = "",
) -> Path:
    """Write `out` as a pipeline folder: `base` without its denoiser (UNet or transformer;
    `denoiser`: that part, Wan 2.2 A14B's trained expert, the other copied as it is), plus these
    weights (and `text_states`: text encoders' weights by part name, e.g. a merged LoRA's);
    `family`: the family that trained it, whose pipeline its model_index.json names where that is
    not the base's (Spec.exported_class)."""
    from zerotuner.families.registry import REGISTRY

    out = Path(out)
    states = {denoiser or denoiser_part(base): unet_state} | (text_states or {})
    modules = {part: built_part(base, part, state) for part, state in states.items()}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(*states, ".*"))
    for part, module in modules.items():
        module.save_pretrained(tmp / part, safe_serialization=True)
    index_file = tmp / "model_index.json"
    index = json.loads(index_file.read_text())
    spec = REGISTRY.get(family)  # (a manifest older than its `family`: the base's class)
    pipeline = spec.exported_class if spec else ""
    if pipeline and index["_class_name"] != pipeline:
        index_file.unlink()  # copied with the base's mode: a read-only mount's 0444
        index_file.write_text(json.dumps({**index, "_class_name": pipeline}, indent=2) + "\n")
    readable_by_all(tmp)  # safetensors writes 0600: the export is for other users too
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
