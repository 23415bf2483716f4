"""Diffusers pipeline folders from trained UNet weights: the run's final/ and `zerotuner export`.

A folder is the base pipeline's frozen parts (VAE, text encoders, tokenizers, scheduler,
model_index.json) copied as they are, plus the trained UNet written with save_pretrained in
safetensors (built on the meta device around the trained tensors: no random init first). It
is built next to the destination and renamed into place, so a reader never sees half an
export. Checkpoints are consolidated with DeepSpeed's own tools: zero_to_fp32 for
ZeRO 1-3 (any world size; an NVMe-offloaded optimizer's swap files put back first), the
module state for stage 0.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from zerotuner import universal
from zerotuner.checkpoint import EMA_FILE, read_manifest
from zerotuner.errors import ConfigError

log = logging.getLogger(__name__)


def denoiser_part(base: Path) -> str:
    """The trained part of a pipeline folder: `unet`, or a transformer family's `transformer`."""
    index = json.loads((Path(base) / "model_index.json").read_text())
    return "unet" if "unet" in index else "transformer"


def load_part(base: Path, part: str, *, weights: bool = True) -> torch.nn.Module:
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


def built_part(base: Path, part: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
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
    return module


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
) -> Path:
    """Write `out` as a pipeline folder: `base` without its denoiser (UNet or transformer),
    plus these weights (and `text_states`: text encoders' weights by part name, e.g. a merged
    LoRA's)."""
    out = Path(out)
    states = {denoiser_part(base): unet_state} | (text_states or {})
    modules = {part: built_part(base, part, state) for part, state in states.items()}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(*states, ".*"))
    for part, module in modules.items():
        module.save_pretrained(tmp / part, safe_serialization=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def checkpoint_unet_state(checkpoint: Path, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """The UNet weights (fp32) of a committed checkpoint, whatever its stage and world size."""
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise ConfigError(f"{checkpoint}: not a committed zerotuner checkpoint (no zerotuner.json)")
    if ema:
        from safetensors.torch import load_file

        if not (checkpoint / EMA_FILE).is_file():
            raise ConfigError(f"{checkpoint}: has no EMA weights (the run had ZT_EMA off)")
        return load_file(str(checkpoint / EMA_FILE))
    if int(manifest["zero_stage"]) == 0:
        states = torch.load(
            checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
        )
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        readable = checkpoint
        if (checkpoint / universal.SWAPPED).is_dir():  # the optimizer was on NVMe
            readable = Path(tmp) / checkpoint.name
            universal.unswap(checkpoint, readable)
        state = get_fp32_state_dict_from_zero_checkpoint(str(readable.parent), tag=readable.name)
    return {k: v.float() for k, v in state.items()}


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    ema: bool = False,
    base: Path | None = None,
    merged: bool = False,
) -> Path:
    """`zerotuner export CKPT OUT`: a checkpoint folder (step-N) to a pipeline folder; of a
    LoRA checkpoint, its adapter files (`merged`: and `OUT/merged/`, the fused pipeline)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ConfigError(f"CKPT={checkpoint}: no such checkpoint folder")
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise ConfigError(
            f"CKPT={checkpoint}: not a committed zerotuner checkpoint (no zerotuner.json)"
        )
    base = Path(base or manifest.get("base_model", ""))
    if not (base / "model_index.json").is_file():
        raise ConfigError(
            f"CKPT={checkpoint}: its base pipeline {base} is gone; pass --base with the "
            "pipeline folder the run trained from"
        )
    if manifest.get("training_type") == "lora":
        from zerotuner import lora_files

        return lora_files.export_checkpoint(checkpoint, manifest, base, out, ema=ema, merged=merged)
    if merged:
        raise ConfigError(
            f"CKPT={checkpoint}: --merged fuses a LoRA adapter into its base; this checkpoint "
            "is from a full run, whose export is a whole pipeline already"
        )
    state = checkpoint_unet_state(checkpoint, ema=ema)
    return write_pipeline(base, state, out)
