"""`zerotuner export CKPT OUT`: a checkpoint (any ZeRO stage, any world size) to a diffusers
pipeline folder, loadable with DiffusionPipeline.from_pretrained."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder, e.g. OUTPUT/checkpoints/step-500"
    )
    parser.add_argument("out", type=Path, help="the pipeline folder to write (replaced if present)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead")
    parser.add_argument(
        "--merged", action="store_true",
        help="LoRA: also write OUT/merged/, the base pipeline with the adapter fused into its UNet",
    )  # fmt: skip
    parser.add_argument(
        "--base", type=Path, default=None,
        help="base pipeline folder, if the one recorded in the checkpoint has moved",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation needs no GPU
    from zerotuner.weights.export import export_checkpoint

    out = export_checkpoint(
        args.checkpoint, args.out, ema=args.ema, base=args.base, merged=args.merged
    )
    log.info("exported %s -> %s", args.checkpoint, out)
    print(out)
    return 0
