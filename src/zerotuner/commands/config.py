"""`zerotuner config`: the normalized DeepSpeed JSON on stdout, every change on stderr."""

from __future__ import annotations

import argparse
import json
import sys

from zerotuner.hardware import probe
from zerotuner.preflight import preflight
from zerotuner.settings import load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explain", action="store_true", help="also print every decision and its reason"
    )


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    result = preflight(settings, hardware=probe(settings.device), require_fit=False)
    shown = {"change", "warning"} | ({"info"} if args.explain else set())
    for note in result.notes:
        if note.level in shown:
            print(f"zerotuner: {note}", file=sys.stderr)
    print(json.dumps(result.normalized.config, indent=2))
    return 0
