"""`zerotuner demo DIR`: write the tiny demo model and dataset (see zerotuner.demo.pipelines)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotuner.families import FAMILIES, FLOW_FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="folder to write model/ and data/ into"
    )
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="sdxl",
        help="architecture of the tiny model (default: sdxl)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and images")


def run(args: argparse.Namespace) -> int:
    from zerotuner.demo.pipelines import DEMO_RESOLUTION, write_demo

    paths = write_demo(args.dir, seed=args.seed, family=args.family)
    root, model, data = paths.root.resolve(), paths.model.resolve(), paths.data.resolve()
    print(f"demo model ({paths.family}, {DEMO_RESOLUTION} px): {model}")
    print(f"demo data ({paths.images} images with captions): {data}")
    flow = paths.family in FLOW_FAMILIES  # flow matching: no DDPM settings in its config
    job = (
        f"ZT_DEVICE=cpu ZT_MODEL={model} ZT_DATA_DIR={data} ZT_CACHE_DIR={root / 'cache'} "
        f"ZT_OFFLOAD_DIR={root / 'offload'} "
        f"ZT_CONFIG_FILE=config/{'demo-flow' if flow else 'demo'}.yaml"
    )
    if flow:
        print("train the whole transformer on it, from the repository's root:")
        print(f"  {job} ZT_OUTPUT_DIR={root / 'output'} ./entrypoint train")
        return 0
    print("train the whole UNet on it (what `make run` does), from the repository's root:")
    print(f"  {job} ZT_OUTPUT_DIR={root / 'output'} ./entrypoint train")
    print("or train a LoRA adapter on it (`make run-lora`; writes final/pytorch_lora_weights.*):")
    print(f"  {job} {LORA_SETTINGS} ZT_OUTPUT_DIR={root / 'output-lora'} ./entrypoint train")
    return 0


# An adapter takes a larger rate than the whole UNet (diffusers' examples: 1e-4 vs 1e-5).
LORA_SETTINGS = "ZT_TRAINING_TYPE=lora ZT_LORA_RANK=16 ZT_LEARNING_RATE=1e-2"
