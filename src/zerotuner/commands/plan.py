"""`zerotuner plan`: memory per ZeRO stage x offload for this machine (or one described by flags).

Without hardware flags it probes this machine and reads the settings, exactly as `train` does.
With `--gpus/--gpu-memory/--host-memory` it plans for hardware you are about to rent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.hardware import GPU, GiB, Hardware
from zerotuner.plan import Plan, gib
from zerotuner.preflight import plan_for

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
    what_if = parser.add_argument_group("what-if (plan for hardware described here)")
    what_if.add_argument("--model-family", choices=("sdxl", "sd1", "sd2"), help="built-in model")
    what_if.add_argument("--resolution", type=int, help="pixels per side (ZT_RESOLUTION)")
    what_if.add_argument("--train-batch-size", type=int, help="micro batch per device")
    what_if.add_argument("--gpus", type=int, help="GPUs per node (0 = CPU accelerator)")
    what_if.add_argument("--gpu-memory", help="memory per GPU, e.g. 24GiB")
    what_if.add_argument("--host-memory", help="host RAM per node, e.g. 128GiB")
    what_if.add_argument("--nodes", type=int, help="nodes (ZT_NNODES)")
    what_if.add_argument("--offload-disk", help="free space for NVMe offload per node, e.g. 2TB")
    what_if.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=None, help="GPUs support bf16"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _what_if_hardware(args: argparse.Namespace, probed_host: int | None) -> Hardware | None:
    if args.gpus is None and args.gpu_memory is None and args.host_memory is None:
        return None
    gpus = 1 if args.gpus is None else args.gpus
    if gpus < 0:
        raise ConfigError(f"--gpus={gpus}: expected 0 (CPU) or more")
    host = parse_size(args.host_memory, "--host-memory") if args.host_memory else probed_host
    if host is None:
        raise ConfigError("--host-memory is needed for a what-if plan, e.g. --host-memory 128GiB")
    if gpus == 0:
        return Hardware("cpu", host_memory=host, cpu_count=os.cpu_count() or 1)
    if not args.gpu_memory:
        raise ConfigError(f"--gpus={gpus} needs --gpu-memory, e.g. --gpu-memory 24GiB")
    memory = parse_size(args.gpu_memory, "--gpu-memory")
    capability = (7, 5) if args.bf16 is False else (8, 0)
    cards = tuple(GPU(i, "what-if GPU", memory, memory, capability) for i in range(gpus))
    return Hardware("cuda", cards, host_memory=host, cpu_count=os.cpu_count() or 1)


def build_plan(args: argparse.Namespace) -> tuple[Plan, Hardware]:
    from zerotuner.families import model_shape
    from zerotuner.hardware import probe
    from zerotuner.inputs import apply_implied_settings, read_user_inputs
    from zerotuner.launch import resolve_topology
    from zerotuner.offload import free_bytes_at
    from zerotuner.preflight import resolve_model
    from zerotuner.settings import load_settings

    overrides: dict[str, Any] = {}
    if args.model_family:
        overrides["model_family"] = args.model_family
    if args.resolution:
        overrides["resolution"] = args.resolution
    if args.train_batch_size:
        overrides["train_batch_size"] = args.train_batch_size
    if args.nodes:
        overrides["nnodes"] = args.nodes
    settings = load_settings(**overrides)
    inputs = read_user_inputs(settings)
    settings = apply_implied_settings(settings, inputs)
    if args.model_family:  # what-if: the family's built-in config, whatever ZT_MODEL holds
        shape = model_shape(args.model_family)
    else:
        source = resolve_model(settings)
        shape = model_shape(source.family, source.local_dir)  # type: ignore[arg-type]
    hardware = _what_if_hardware(args, None if args.host_memory else _host_memory())
    what_if = hardware is not None
    if hardware is None:
        hardware = probe(settings.device, ops=True)
    if what_if:
        per_node = settings.num_processes or hardware.device_count
        world = per_node * (settings.nnodes or 1)
        disk = parse_size(args.offload_disk, "--offload-disk") if args.offload_disk else None
    else:
        topology = resolve_topology(settings, hardware, os.environ)
        per_node, world = topology.nproc_per_node, topology.world_size
        disk = (
            parse_size(args.offload_disk, "--offload-disk")
            if args.offload_disk
            else free_bytes_at(Path(settings.offload_dir))
        )
    plan = plan_for(
        settings,
        shape,
        hardware,
        base=inputs.deepspeed,
        world_size=world,
        ranks_per_node=per_node,
        offload_disk_free=disk,
    )
    return plan, hardware


def _host_memory() -> int:
    from zerotuner.hardware import host_memory, probe_facts

    facts = probe_facts("cpu", {}, ops=False)
    return host_memory(facts.mem_total, facts.cgroup_limit)


def describe_hardware(hardware: Hardware) -> str:
    if hardware.accelerator == "cpu":
        head = "CPU accelerator (no GPU)"
    else:
        names = sorted({g.name for g in hardware.gpus})
        head = f"{len(hardware.gpus)} x {', '.join(names)} {gib(hardware.min_device_memory)} GiB"
        head += " (bf16)" if hardware.bf16 else " (no bf16)"
    return f"{head}; host {gib(hardware.host_memory)} GiB; {hardware.cpu_count} CPUs"


def render(plan: Plan, hardware: Hardware) -> str:
    i = plan.inputs
    lines = [
        f"hardware: {describe_hardware(hardware)}",
        f"job: {i['family']} UNet {i['unet_params'] / 1e9:.3f}B params, {i['resolution']} px, "
        f"micro batch {i['micro_batch']}, world size {i['world_size']}, {i['precision']}",
        "",
        f"{'stage':>5}  {'optimizer':<9}  {'params':<6}  {'ckpt':<4}  "
        f"{'device GiB':>10}  {'host GiB':>8}  {'disk GiB':>8}  fits",
    ]
    for r in plan.rows:
        mark = "<- choice" if r == plan.choice else ""
        lines.append(
            f"{r.zero_stage:>5}  {r.offload_optimizer:<9}  {r.offload_param:<6}  "
            f"{'on' if r.gradient_checkpointing else 'off':<4}  {gib(r.device_bytes):>10}  "
            f"{gib(r.host_bytes):>8}  {gib(r.disk_bytes):>8}  {'yes' if r.fits else 'no ':<4}"
            f"{mark}"
        )
    lines += ["", f"choice: {plan.choice.label()}"]
    lines += [f"  - {reason}" for reason in plan.reasons]
    lines += [f"warning: {w}" for w in hardware.warnings]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plan, hardware = build_plan(args)
    if args.json:
        data = plan.to_dict()
        data["hardware"] = describe_hardware(hardware)
        data["warnings"] = list(hardware.warnings)
        print(json.dumps(data, indent=2))
    else:
        print(render(plan, hardware))
    return 0
