"""The what-if hardware flags `plan` and `config` share: describe a machine instead of probing.

Without `--gpus/--gpu-memory/--host-memory` a command probes this machine, as `train` does.
With any of them the described machine replaces the probe, so a config or plan for hardware you
are about to rent can be worked out on a laptop. Either way only the world size matters here:
a multi-node job needs no rendezvous address (`train` and `check` still demand one).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.launch.ranks import Topology, resolve_topology
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.settings.schema import Settings

_UNITS = {"": GiB, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6}
_UNITS |= {"mib": 1024**2, "g": GiB, "gb": 10**9, "gib": GiB, "t": 1024**4, "tb": 10**12}
_UNITS |= {"tib": 1024**4}


def parse_size(text: str, flag: str) -> int:
    """'24GiB', '80GB', '1.5TiB'; a bare number means GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag}={text}: expected a size such as 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


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


@dataclass(frozen=True)
class WhatIf:
    """The machine the what-if flags describe; all None: probe this one. The CLI reads it from
    its flags (`from_args`), the builder from its form's hardware fields."""

    gpus: int | None = None
    gpu_memory: str | None = None
    host_memory: str | None = None
    nodes: int | None = None
    offload_disk: str | None = None
    bf16: bool | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WhatIf:
        return cls(args.gpus, args.gpu_memory, args.host_memory, args.nodes, args.offload_disk,
                   args.bf16)  # fmt: skip


def settings_overrides(args: WhatIf) -> dict[str, Any]:
    return {"nnodes": args.nodes} if args.nodes else {}


def is_described(args: WhatIf) -> bool:
    return any(v is not None for v in (args.gpus, args.gpu_memory, args.host_memory))


def described_hardware(args: WhatIf, device_setting: str) -> Hardware | None:
    """The machine the flags describe; None when they describe none (probe this one)."""
    if not is_described(args):
        return None
    gpus = 1 if args.gpus is None else args.gpus
    if gpus < 0:
        raise ConfigError(f"--gpus={gpus}: expected 0 (CPU) or more")
    if (device_setting == "cpu" and gpus > 0) or (device_setting == "cuda" and gpus == 0):
        raise ConfigError(
            f"ZT_DEVICE={device_setting} contradicts --gpus={gpus}: unset ZT_DEVICE or describe "
            f"{'no GPUs (--gpus 0)' if device_setting == 'cpu' else 'the GPUs (--gpus N)'}"
        )
    host = parse_size(args.host_memory, "--host-memory") if args.host_memory else _host_memory()
    if gpus == 0:
        return Hardware("cpu", host_memory=host, cpu_count=os.cpu_count() or 1)
    if not args.gpu_memory:
        raise ConfigError(f"--gpus={gpus} needs --gpu-memory, e.g. --gpu-memory 24GiB")
    memory = parse_size(args.gpu_memory, "--gpu-memory")
    capability = (7, 5) if args.bf16 is False else (8, 0)
    cards = tuple(GPU(i, "what-if GPU", memory, memory, capability) for i in range(gpus))
    return Hardware("cuda", cards, host_memory=host, cpu_count=os.cpu_count() or 1)


def hardware_for(args: WhatIf, settings: Settings, *, ops: bool = True) -> Hardware:
    """The described machine, else this one probed (ROCm and MPS refused, exit 3)."""
    from zerotuner.machine.hardware import require_supported
    from zerotuner.machine.probe import probe

    hardware = described_hardware(args, settings.device)
    if hardware is None:
        hardware = probe(settings.device, ops=ops)
        require_supported(hardware)
    return hardware


def topology_for(
    settings: Settings, hardware: Hardware, environ: Mapping[str, str] | None = None
) -> Topology:
    """Ranks per node and nodes as `train` would resolve them, minus the rendezvous address
    (`environ`: the variables the settings were read from; torchrun's among them count)."""
    return resolve_topology(
        settings, hardware, os.environ if environ is None else environ, rendezvous=False
    )


def offload_disk_free(args: WhatIf, settings: Settings) -> int | None:
    """--offload-disk, else (probing) the free space at ZT_OFFLOAD_DIR, else unknown."""
    if args.offload_disk:
        return parse_size(args.offload_disk, "--offload-disk")
    if is_described(args):
        return None
    from zerotuner.machine.offload_volume import free_bytes_at

    return free_bytes_at(Path(settings.offload_dir))


def _host_memory() -> int:
    from zerotuner.machine.hardware import host_memory
    from zerotuner.machine.probe import probe_facts

    facts = probe_facts("cpu", {}, ops=False)
    return host_memory(facts.mem_total, facts.cgroup_limit)
