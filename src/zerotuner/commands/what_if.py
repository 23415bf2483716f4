"""The what-if hardware flags `plan` and `config` share: describe a machine instead of probing
(zerotuner.preflight.what_if answers for it).

Without `--gpus/--gpu-memory/--host-memory` a command probes this machine, as `train` does.
With any of them the described machine replaces the probe, so a config or plan for hardware you
are about to rent can be worked out on a laptop.
"""

from __future__ import annotations

import argparse

from zerotuner.preflight.what_if import WhatIf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what_if = parser.add_argument_group("what-if (hardware described here instead of probed)")
    what_if.add_argument("--gpus", type=int, help="GPUs per node (0 = CPU accelerator)")
    what_if.add_argument("--gpu-memory", help="memory per GPU, e.g. 24GiB")
    what_if.add_argument(
        "--host-memory", help="host RAM per node, e.g. 128GiB (default: this one's)"
    )
    what_if.add_argument("--nodes", type=int, help="nodes (ZT_NNODES)")
    what_if.add_argument("--offload-disk", help="free NVMe offload space per node, e.g. 2TB")
    what_if.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=None, help="GPUs support bf16"
    )


def from_args(args: argparse.Namespace) -> WhatIf:
    return WhatIf(args.gpus, args.gpu_memory, args.host_memory, args.nodes, args.offload_disk,
                  args.bf16)  # fmt: skip
