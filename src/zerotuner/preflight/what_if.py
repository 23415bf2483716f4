"""What-if answers: the DeepSpeed config and the plan for a machine described instead of probed.

`zerotuner config` and `zerotuner plan` take the machine from their flags, the builder page from
its form; each asks here once (`answer_what_if`), and the answer is one pass of the preflight
steps `train` takes (`steps.PreflightRun`), from which the plan and the config are both read.
Without a description (a WhatIf of Nones) this machine is probed, as `train` does. Either way
only the world size matters: a multi-node job needs no rendezvous address (`train` and `check`
still demand one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import ConfigError, EnvironmentUnfit, ZeroTunerError
from zerotuner.launch.ranks import Topology, resolve_topology
from zerotuner.machine.hardware import GPU, GiB, Hardware, describe_hardware
from zerotuner.settings.effective import effective_settings
from zerotuner.settings.schema import Settings

if TYPE_CHECKING:
    from zerotuner.preflight.plan import Plan
    from zerotuner.preflight.steps import Preflight, PreflightRun

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


@dataclass(frozen=True)
class WhatIfAnswer:
    """`PreflightRun`'s steps, taken once on the machine a WhatIf describes: the plan `plan`
    prints and the preflight `config` prints, both from the sequence `train` takes."""

    what: WhatIf
    run: PreflightRun | None  # None: refused before the first step (settings, the machine)
    error: ZeroTunerError | None = None  # the refusal that stopped the steps
    result: Preflight | None = None  # every step's, when none refused

    def plan(self) -> tuple[Plan, Hardware]:
        """What `plan` prints: the plan and the machine it is for. The steps after the plan
        (the DeepSpeed config) are `config`'s to refuse; a plan the machine cannot run is
        refused as `train` refuses it (exit 3)."""
        if self.run is None or self.run.plan is None:
            assert self.error is not None
            raise self.error
        if self.run.plan.unfit:
            raise EnvironmentUnfit(self.run.plan.unfit)
        assert self.run.hardware is not None
        return self.run.plan, self.run.hardware

    def preflight(self) -> Preflight:
        """What `config` prints: every step's result. A machine that cannot run the job (no
        GPU for ZT_DEVICE=cuda, ROCm, MPS) is no verdict on the config: exit 2, with the way to
        check it anyway when this machine was probed."""
        if isinstance(self.error, EnvironmentUnfit):
            # the hint is for a machine that refused the job; a store that could not be reached
            # refuses once the machine was described (run.hardware), and other hardware is no fix
            machine = self.run is None or self.run.hardware is None
            hint = f"; {DESCRIBE}" if machine and not is_described(self.what) else ""
            raise ConfigError(f"{self.error}{hint}") from None
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    @property
    def described(self) -> str | None:
        """The described hardware in words; None when this machine was probed."""
        if not is_described(self.what) or self.run is None or self.run.hardware is None:
            return None
        return describe_hardware(self.run.hardware)


def answer_what_if(
    what: WhatIf,
    environ: Mapping[str, str] | None = None,
    *,
    model_family: str | None = None,
    resolution: int | None = None,
    train_batch_size: int | None = None,
) -> WhatIfAnswer:
    """`PreflightRun`'s steps, once, for the settings read from `environ` (None: the
    process's; the builder passes its form's) on the machine `what` describes (else this one,
    probed). Planned with `require_fit=False`, so a plan the machine cannot run still reaches
    the DeepSpeed config (`WhatIfAnswer.plan` refuses it, as `train` would). A described
    machine is neither probed nor its offload disk measured. `model_family`, `resolution`,
    `train_batch_size`: a what-if job (`plan`'s flags); a family given is planned from its
    built-in config, ZT_MODEL unresolved (nothing fetched for it)."""
    from zerotuner.preflight.steps import ModelSource, PreflightRun  # torch, through lora

    overrides: dict[str, Any] = settings_overrides(what)
    job = {"model_family": model_family, "resolution": resolution,
           "train_batch_size": train_batch_size}  # fmt: skip
    overrides |= {name: value for name, value in job.items() if value}
    run = None
    if is_described(what):  # DeepSpeed only parses the JSON: skip its device probe
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (whose warning goes to stdout)
    try:
        effective = effective_settings(environ, **overrides)
        settings = effective.settings
        hardware = hardware_for(what, settings)
        run = PreflightRun(
            effective, hardware=hardware, topology=topology_for(settings, hardware, environ),
            require_fit=False, offload_disk_free=offload_disk_free(what, settings),
            model=ModelSource(model_family, None, "--model-family") if model_family else None,
        )  # fmt: skip
        return WhatIfAnswer(what, run, result=run.run())
    except ZeroTunerError as error:
        return WhatIfAnswer(what, run, error)


def plan_json(plan: Plan, hardware: Hardware) -> dict[str, Any]:
    """What `plan --json` prints (the builder page and the run page show the same)."""
    data = plan.to_dict()
    data["hardware"] = describe_hardware(hardware)
    data["warnings"] = list(hardware.warnings)
    return data
