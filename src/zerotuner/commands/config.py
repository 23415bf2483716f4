"""`zerotuner config`: the normalized DeepSpeed JSON on stdout, every change on stderr.

Exit 0 for a valid config, 2 for an invalid one: never 3. A machine that cannot run the job
(no GPU for ZT_DEVICE=cuda, ROCm, MPS) is not a verdict on the config, so that is exit 2 with
the way to check it anyway: describe the hardware it is for with the what-if flags.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerotuner.commands import what_if
from zerotuner.preflight.what_if import answer_what_if


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explain", action="store_true", help="also print every decision and its reason"
    )
    what_if.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    answer = answer_what_if(what_if.from_args(args))
    result, described = answer.preflight(), answer.described
    if described is not None:
        print(f"zerotuner: for described hardware: {described}", file=sys.stderr)
    shown = {"change", "warning"} | ({"info"} if args.explain else set())
    for note in result.notes:
        if note.level in shown:
            print(f"zerotuner: {note}", file=sys.stderr)
    print(json.dumps(result.normalized.config, indent=2))
    return 0
