"""What-if answers: the DeepSpeed config and the plan for a machine described instead of probed.

`zerotuner config` and `zerotuner plan` take the machine from their flags, the builder page from
its form; both ask here. Without a description (a WhatIf of Nones) this machine is probed, as
`train` does. Either way only the world size matters: a multi-node job needs no rendezvous
address (`train` and `check` still demand one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.launch.ranks import Topology, resolve_topology
from zerotuner.machine.hardware import GPU, GiB, Hardware, describe_hardware
from zerotuner.settings.effective import effective_settings
from zerotuner.settings.schema import Settings

if TYPE_CHECKING:
    from zerotuner.preflight.plan import Plan
    from zerotuner.preflight.steps import Preflight

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


@dataclass(frozen=True)
class WhatIf:
    """The machine the what-if flags describe; all None: probe this one. The CLI reads it from
    its flags (commands/what_if.py), the builder from its form's hardware fields."""

    gpus: int | None = None
    gpu_memory: str | None = None
    host_memory: str | None = None
    nodes: int | None = None
    offload_disk: str | None = None
    bf16: bool | None = None


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


DESCRIBE = (
    "to check the config for the hardware it is for, describe that: "
    "`zerotuner config --gpus N --gpu-memory SIZE` (e.g. --gpus 1 --gpu-memory 24GiB)"
)


def explain_config(
    what: WhatIf, environ: Mapping[str, str] | None = None
) -> tuple[Preflight, str | None]:
    """What `zerotuner config` prints, computed (the builder page asks too, with the form's
    variables as `environ`): the preflight, and the described hardware in words (None when
    this machine was probed)."""
    from zerotuner.machine.hardware import describe_hardware
    from zerotuner.preflight.steps import preflight  # torch, through lora

    effective = effective_settings(environ, **settings_overrides(what))
    settings = effective.settings
    if is_described(what):  # DeepSpeed only parses the JSON: skip its device probe
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (whose warning goes to stdout)
    try:
        hardware = hardware_for(what, settings)
        topology = topology_for(settings, hardware, environ)
        result = preflight(
            effective, hardware=hardware, topology=topology, require_fit=False,
            offload_disk_free=offload_disk_free(what, settings),
        )  # fmt: skip
    except EnvironmentUnfit as error:
        hint = "" if is_described(what) else f"; {DESCRIBE}"
        raise ConfigError(f"{error}{hint}") from None
    return result, describe_hardware(hardware) if is_described(what) else None


def plan_what_if(
    what: WhatIf,
    *,
    model_family: str | None = None,
    resolution: int | None = None,
    train_batch_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Plan, Hardware]:
    """What `zerotuner plan` prints, computed (the builder page asks too, with the form's
    variables as `environ`). `model_family`, `resolution`, `train_batch_size`: the what-if
    job."""
    from zerotuner.families import EXPERTS, check_family_settings, model_shape
    from zerotuner.preflight.steps import resolve_model
    from zerotuner.settings.effective import effective_settings

    overrides: dict[str, Any] = settings_overrides(what)
    if model_family:
        overrides["model_family"] = model_family
    if resolution:
        overrides["resolution"] = resolution
    if train_batch_size:
        overrides["train_batch_size"] = train_batch_size
    effective = effective_settings(environ, **overrides)
    settings, inputs = effective.settings, effective.inputs
    model_dir = None
    if model_family:  # what-if: the family's built-in config, whatever ZT_MODEL holds
        shape = model_shape(model_family)
    else:
        source = resolve_model(settings, offline=effective.hub_offline)
        expert = EXPERTS.get(settings.expert or "")  # A14B: the expert trained
        shape = model_shape(source.family, source.local_dir, denoiser=expert)  # type: ignore[arg-type]
        model_dir = source.local_dir
    check_family_settings(settings, shape.family, shape)  # as `train` would refuse them
    hardware = hardware_for(what, settings, ops=True)
    topology = topology_for(settings, hardware, environ)
    from zerotuner.preflight.steps import plan_for  # torch, through lora

    plan = plan_for(
        settings,
        shape,
        hardware,
        base=inputs.deepspeed,
        world_size=topology.world_size,
        ranks_per_node=topology.nproc_per_node,
        offload_disk_free=offload_disk_free(what, settings),
        model_dir=model_dir,
    )
    return plan, hardware


def plan_json(plan: Plan, hardware: Hardware) -> dict[str, Any]:
    """What `plan --json` prints (the builder page and the run page show the same)."""
    data = plan.to_dict()
    data["hardware"] = describe_hardware(hardware)
    data["warnings"] = list(hardware.warnings)
    return data
