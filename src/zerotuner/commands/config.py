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
from collections.abc import Mapping
from typing import TYPE_CHECKING

from zerotuner.commands import what_if
from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.settings.effective import effective_settings

if TYPE_CHECKING:
    from zerotuner.preflight.steps import Preflight

DESCRIBE = (
    "to check the config for the hardware it is for, describe that: "
    "`zerotuner config --gpus N --gpu-memory SIZE` (e.g. --gpus 1 --gpu-memory 24GiB)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--explain", action="store_true", help="also print every decision and its reason"
    )
    what_if.add_arguments(parser)


def evaluate(
    what: what_if.WhatIf, environ: Mapping[str, str] | None = None
) -> tuple[Preflight, str | None]:
    """What `config` prints, computed (the builder page calls it too, with the form's variables
    as `environ`): the preflight, and the described hardware in words (None when this machine
    was probed)."""
    args = what
    from zerotuner.machine.hardware import describe_hardware
    from zerotuner.preflight.steps import preflight  # torch, through lora: not for --help

    effective = effective_settings(environ, **what_if.settings_overrides(args))
    settings = effective.settings
    if what_if.is_described(args):  # DeepSpeed only parses the JSON: skip its device probe
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (whose warning goes to stdout)
    try:
        hardware = what_if.hardware_for(args, settings)
        topology = what_if.topology_for(settings, hardware, environ)
        result = preflight(
            effective, hardware=hardware, topology=topology, require_fit=False,
            offload_disk_free=what_if.offload_disk_free(args, settings),
        )  # fmt: skip
    except EnvironmentUnfit as error:
        hint = "" if what_if.is_described(args) else f"; {DESCRIBE}"
        raise ConfigError(f"{error}{hint}") from None
    return result, describe_hardware(hardware) if what_if.is_described(args) else None


def run(args: argparse.Namespace) -> int:
    result, described = evaluate(what_if.WhatIf.from_args(args))
    if described is not None:
        print(f"zerotuner: for described hardware: {described}", file=sys.stderr)
    shown = {"change", "warning"} | ({"info"} if args.explain else set())
    for note in result.notes:
        if note.level in shown:
            print(f"zerotuner: {note}", file=sys.stderr)
    print(json.dumps(result.normalized.config, indent=2))
    return 0
