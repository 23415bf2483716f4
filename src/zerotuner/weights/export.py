"""`zerotuner export`: a committed checkpoint to what the run's final/ would hold: a pipeline
folder of a full run, the adapter files of a LoRA run (and on request its merged pipeline).

Checkpoints are consolidated with DeepSpeed's own tools: zero_to_fp32 for ZeRO 1-3 (any world
size; an NVMe-offloaded optimizer's swap files put back first), the module state for stage 0.
The folders themselves are written by `pipeline_folder` and `lora_files`.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.weights import universal
from zerotuner.weights.checkpoint import EMA_FILE, read_manifest
from zerotuner.weights.pipeline_folder import load_part, write_pipeline

log = logging.getLogger(__name__)


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
        return _export_lora(checkpoint, manifest, base, out, ema=ema, merged=merged)
    if merged:
        raise ConfigError(
            f"CKPT={checkpoint}: --merged fuses a LoRA adapter into its base; this checkpoint "
            "is from a full run, whose export is a whole pipeline already"
        )
    state = checkpoint_unet_state(checkpoint, ema=ema)
    return write_pipeline(
        base, state, out, denoiser=manifest.get("denoiser"), family=manifest.get("family", "")
    )


def _export_lora(
    checkpoint: Path,
    manifest: dict[str, Any],
    base: Path,
    out: Path,
    *,
    ema: bool = False,
    merged: bool = False,
) -> Path:
    """A LoRA checkpoint's adapter (consolidated from any stage and world size; `ema`: the EMA
    of it) as `out/pytorch_lora_weights.safetensors` (and with `merged`, `out/merged/`),
    checked against the shapes the manifest's adapter has on the base UNet (and text
    encoders, if they trained; all built on the meta device)."""
    from zerotuner import families
    from zerotuner.weights import lora_text
    from zerotuner.weights.lora import (
        ADAPTER,
        initial_adapter,
        make_config,
        metadata,
        resolve_targets,
        shapes,
    )
    from zerotuner.weights.lora_files import write_adapter

    adapter, family = manifest["lora"], manifest["family"]
    part = manifest.get("denoiser")  # Wan 2.2 A14B's expert; else the family's own
    denoiser = copy.deepcopy(families.meta_model(family, base, part))  # the adapter goes on it
    adapter = adapter | {"targets": list(resolve_targets(denoiser, adapter["targets"]))}
    config = make_config(adapter | {"init": "gaussian"})  # its shapes: nothing to read here
    denoiser.requires_grad_(False)
    denoiser.add_adapter(config, adapter_name=ADAPTER)
    module, text_metadata = denoiser, None
    if adapter.get("text_encoder"):
        module = lora_text.meta_module(denoiser, base, family, adapter)
        text_metadata = metadata(lora_text.text_config(adapter))
    initial, init = None, adapter.get("init", "gaussian")
    if init != "gaussian":  # its start, from the base weights again
        start = load_part(base, part or families.get(family).denoiser)
        start.add_adapter(make_config(adapter), adapter_name=ADAPTER)
        initial = initial_adapter(start, init)
    state = checkpoint_unet_state(checkpoint, ema=ema)
    return write_adapter(
        family, {name: t for name, t in state.items() if ".lora_" in name}, shapes(module),
        metadata(config), out, text_metadata=text_metadata, merge_base=base if merged else None,
        initial=initial, denoiser=part, base=base,
    )  # fmt: skip


def export_adapter_file(
    adapter: Path, out: Path, *, family: str | None, base: Path | None = None
) -> Path:
    """`zerotuner export ADAPTER OUT --family F`: a diffusers adapter file (a LoRA run's
    final/, or its pytorch_lora_weights.safetensors) into `out` with its kohya and ComfyUI
    files beside it (a DoRA adapter's ComfyUI file needs `base`, the pipeline it trained on)."""
    import shutil

    from zerotuner import families
    from zerotuner.weights import lora_files, lora_layouts

    adapter = Path(adapter)
    if adapter.is_dir():
        adapter = adapter / lora_files.ADAPTER_FILE
    if family not in families.FAMILIES:
        raise ConfigError(
            f"ADAPTER={adapter}: an adapter file does not say its model family; pass --family "
            f"({', '.join(families.FAMILIES)})"
        )
    parts, configs = lora_layouts.read_diffusers(adapter)
    kind = families.get(family)
    # its layers must be the family's (names decide the ComfyUI layout): the model is built
    # on the meta device, of `base`'s config or the published one
    layers = {n for n, _ in families.meta_model(family, base).named_modules()}
    alien = sorted({k.split(".lora_")[0] for k in parts.get(kind.denoiser, {})} - layers)
    if kind.denoiser not in parts or alien:
        shown = alien[0] if alien else f"its parts {', '.join(sorted(parts))}"
        raise ConfigError(
            f"ADAPTER={adapter}: {shown} is not a layer of a {family} model's {kind.denoiser}; "
            "pass the --family it was trained for"
        )
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(adapter, tmp / lora_files.ADAPTER_FILE)
    lora_files.write_layouts(tmp, kind, parts, configs[kind.denoiser], base=base)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
