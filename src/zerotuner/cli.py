"""The `zerotuner` command line: one module per command under `zerotuner.commands`.

Errors the user can act on print one line each (no traceback) and exit with the code the
public interface fixes: 2 for configuration, 3 for an unfit environment.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from zerotuner import __version__
from zerotuner.errors import ZeroTunerError
from zerotuner.monitor.logs import demote_known_noise, quiet_http_logs

log = logging.getLogger("zerotuner")

COMMANDS = {
    "train": "preflight, plan, normalize, prepare the offload volume, launch ranks, train, export",
    "config": "print the normalized DeepSpeed JSON (changes and warnings on stderr)",
    "plan": "detected hardware, memory estimate per ZeRO stage/offload, the choice and why",
    "check": "validate everything `train` would, without training",
    "demo": "write the tiny demo model and dataset used by `make run`",
    "export": "consolidate a checkpoint into a diffusers pipeline folder",
    "builder": "the config builder page: settings -> DeepSpeed JSON, plan, exports",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerotuner",
        description="DeepSpeed fine-tuning appliance for diffusion models (SD 1.x/2.x, SDXL, SD3, "
        "Flux.1), whole or as LoRA. "
        "Configured by ZT_* environment variables and mounted files.",
    )
    parser.add_argument("--version", action="version", version=f"zerotuner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        _module(name).add_arguments(command)
    return parser


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"zerotuner.commands.{name}")


def report_error(error: ZeroTunerError) -> None:
    for line in error.problems:
        print(f"zerotuner: error: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_http_logs()
    demote_known_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["train", *(argv or [])])
    try:  # the commands that read settings start with effective.effective_settings
        return int(_module(args.command).run(args) or 0)
    except ZeroTunerError as error:
        report_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
