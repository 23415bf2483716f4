"""`zerotuner demo DIR`: write the tiny demo model and dataset (see zerotuner.demo.pipelines)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotuner.families import FAMILIES, FLOW_FAMILIES, REGISTRY


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
    from zerotuner.demo.parts import DEMO_RESOLUTION
    from zerotuner.demo.pipelines import write_demo

    paths = write_demo(args.dir, seed=args.seed, family=args.family)
    root, model, data = paths.root.resolve(), paths.model.resolve(), paths.data.resolve()
    print(f"demo model ({paths.family}, {DEMO_RESOLUTION} px): {model}")
    # an edit family's demo images each have a control image beside them (foo.control.png);
    # FLUX.2's, whose references are optional, are its text-to-image demo
    spec = REGISTRY[paths.family]
    pairs = " and control images" if spec.controls and not spec.optional_controls else ""
    print(f"demo data ({paths.images} images with captions{pairs}): {data}")
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
    from zerotuner.demo.concept import TRIGGER, write_concept_dataset

    concept = write_concept_dataset(root / "data-lora", seed=args.seed).resolve()
    print(f"demo concept for a LoRA (shapes behind the trigger word {TRIGGER!r}): {concept}")
    print("train the whole UNet on it (what `make run` does), from the repository's root:")
    print(f"  {job} ZT_OUTPUT_DIR={root / 'output'} ./entrypoint train")
    print("then teach the trained UNet the new concept with a LoRA adapter (`make run-lora`):")
    print(
        f"  ZT_DEVICE=cpu ZT_MODEL={root / 'output' / 'final'} ZT_DATA_DIR={concept} "
        f"ZT_CACHE_DIR={root / 'cache'} ZT_OFFLOAD_DIR={root / 'offload'} "
        f"ZT_CONFIG_FILE=config/demo-lora.yaml ZT_OUTPUT_DIR={root / 'output-lora'} "
        "./entrypoint train"
    )
    return 0
