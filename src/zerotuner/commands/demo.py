"""`zerotuner demo DIR`: write the tiny demo model and dataset (see zerotuner.demo)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="folder to write model/ and data/ into"
    )
    parser.add_argument(
        "--family",
        choices=("sdxl", "sd1", "sd2"),
        default="sdxl",
        help="architecture of the tiny model (default: sdxl)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and images")


def run(args: argparse.Namespace) -> int:
    from zerotuner.demo import DEMO_RESOLUTION, write_demo

    paths = write_demo(args.dir, seed=args.seed, family=args.family)
    print(f"demo model ({paths.family}, {DEMO_RESOLUTION} px): {paths.model.resolve()}")
    print(f"demo data ({paths.images} images with captions): {paths.data.resolve()}")
    print(f"train on it: ZT_MODEL={paths.model.resolve()} ZT_DATA_DIR={paths.data.resolve()}")
    return 0
