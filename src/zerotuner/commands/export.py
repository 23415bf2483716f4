"""`zerotuner export CKPT OUT`: a checkpoint (any ZeRO stage, any world size) to a diffusers
pipeline folder, loadable with DiffusionPipeline.from_pretrained; of a LoRA checkpoint, or of a
diffusers adapter file with --family, the adapter files (diffusers, kohya, ComfyUI)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path,
        help="a checkpoint folder, e.g. OUTPUT/checkpoints/step-500; or, with --family, a "
        "diffusers LoRA adapter file (or the folder holding pytorch_lora_weights.safetensors)",
    )  # fmt: skip
    parser.add_argument("out", type=Path, help="the pipeline folder to write (replaced if present)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead")
    parser.add_argument(
        "--merged", action="store_true",
        help="LoRA: also write OUT/merged/, the base pipeline with the adapter fused into its UNet",
    )  # fmt: skip
    parser.add_argument(
        "--base", type=Path, default=None,
        help="base pipeline folder, if the one recorded in the checkpoint has moved (an adapter "
        "file: the pipeline it trained on, which a DoRA adapter's ComfyUI file needs)",
    )  # fmt: skip
    parser.add_argument(
        "--family", default=None,
        help="the model family of an adapter file (sdxl, flux, wan, ...): OUT gets the file, "
        "its kohya copy (UNet families) and pytorch_lora_weights_comfyui.safetensors",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation needs no GPU
    from zerotuner.weights.export import export_adapter_file, export_checkpoint

    if args.family is not None or args.checkpoint.suffix == ".safetensors":
        if args.ema or args.merged:
            from zerotuner.errors import ConfigError

            raise ConfigError("--ema and --merged take a checkpoint folder, not an adapter file")
        out = export_adapter_file(args.checkpoint, args.out, family=args.family, base=args.base)
    else:
        out = export_checkpoint(
            args.checkpoint, args.out, ema=args.ema, base=args.base, merged=args.merged
        )
    log.info("exported %s -> %s", args.checkpoint, out)
    print(out)
    return 0
