"""`zerotuner config`: the normalized DeepSpeed JSON on stdout, every change on stderr.

Exit 0 for a valid config, 2 for an invalid one: never 3. A machine that cannot run the job
(no GPU for ZT_DEVICE=cuda, ROCm, MPS) is not a verdict on the config, so that is exit 2 with
the way to check it anyway: describe the hardware it is for with the what-if flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from zerotuner.commands import what_if
from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.inputs import apply_implied_settings, read_user_inputs
from zerotuner.settings import load_settings

if TYPE_CHECKING:
    from zerotuner.preflight import Preflight

DESCRIBE = (
    "to check the config for the hardware it is for, describe that: "
    "`zerotuner config --gpus N --gpu-memory SIZE` (e.g. --gpus 1 --gpu-memory 24GiB)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explain", action="store_true", help="also print every decision and its reason"
    )
    what_if.add_arguments(parser)


def evaluate(args: argparse.Namespace) -> tuple[Preflight, str | None]:
    """What `config` prints, computed (the builder page calls it too): the preflight, and the
    described hardware in words (None when this machine was probed)."""
    from zerotuner.commands.plan import describe_hardware
    from zerotuner.preflight import preflight  # torch, through lora: not for --help

    settings = load_settings(**what_if.settings_overrides(args))
    if what_if.is_described(args):  # DeepSpeed only parses the JSON: skip its device probe
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (whose warning goes to stdout)
    try:
        hardware = what_if.hardware_for(args, settings)
        inputs = read_user_inputs(settings)
        settings = apply_implied_settings(settings, inputs)
        topology = what_if.topology_for(settings, hardware)
        result = preflight(
            settings, hardware=hardware, topology=topology, require_fit=False,
            offload_disk_free=what_if.offload_disk_free(args, settings), inputs=inputs,
        )  # fmt: skip
    except EnvironmentUnfit as error:
        hint = "" if what_if.is_described(args) else f"; {DESCRIBE}"
        raise ConfigError(f"{error}{hint}") from None
    return result, describe_hardware(hardware) if what_if.is_described(args) else None


def run(args: argparse.Namespace) -> int:
    result, described = evaluate(args)
    if described is not None:
        print(f"zerotuner: for described hardware: {described}", file=sys.stderr)
    shown = {"change", "warning"} | ({"info"} if args.explain else set())
    for note in result.notes:
        if note.level in shown:
            print(f"zerotuner: {note}", file=sys.stderr)
    print(json.dumps(result.normalized.config, indent=2))
    return 0
