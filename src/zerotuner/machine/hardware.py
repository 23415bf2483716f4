"""What the machine offers: the description every decision is made from.

Probing (torch.cuda, NVML, /proc, /sys, rlimits: probe.py) is thin I/O that fills
`Facts`; `describe`
turns facts into `Hardware` and `diagnose` turns them into warnings with the fix. Both are pure,
so every decision is tested by feeding described machines (a CUDA GPU cannot exist here).
Everything downstream (plan, normalize) takes `Hardware` as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.machine.driver import Driver, describe_driver, driver_problem, driver_warnings

Accelerator = Literal["cuda", "cpu", "rocm", "mps"]

GiB = 1024**3
MiB = 1024**2

DOCKER_DEFAULT_SHM = 64 * MiB
MIN_SHM = 1 * GiB  # NCCL and DataLoader workers exchange tensors through /dev/shm


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_memory: int  # bytes
    free_memory: int  # bytes
    compute_capability: tuple[int, int] = (8, 0)
    uuid: str = ""
    pci_bus_id: str = ""

    @property
    def bf16(self) -> bool:
        return self.compute_capability >= (8, 0)  # Ampere and newer


@dataclass(frozen=True)
class OpStatus:
    """One DeepSpeed op: can it run here, and does it need a JIT compile first."""

    name: str
    compatible: bool  # the op builder's is_compatible(): headers, libraries, arch
    prebuilt: bool  # compiled into the installed wheel (DS_BUILD_*=1 at install)
    jit_possible: bool  # ninja and a C++ compiler (plus nvcc for CUDA ops) are present

    @property
    def loadable(self) -> bool:
        return self.compatible and (self.prebuilt or self.jit_possible)


@dataclass(frozen=True)
class Hardware:
    accelerator: Accelerator
    gpus: tuple[GPU, ...] = ()
    host_memory: int = 16 * GiB  # bytes of RAM available to this container
    cpu_count: int = 1
    shm_bytes: int | None = None
    memlock_bytes: int | None = None  # None = unlimited
    warnings: tuple[str, ...] = field(default_factory=tuple)
    driver_capabilities: str | None = None  # NVIDIA_DRIVER_CAPABILITIES as the container sees it
    ops: tuple[OpStatus, ...] = ()  # DeepSpeed ops; empty = not probed
    libaio: bool | None = None  # None = not probed
    driver: Driver | None = None  # NVML's view; None = no NVML or not probed
    image_cuda: tuple[int, int] | None = None  # the CUDA PyTorch is built for; None = CPU build

    @property
    def device_count(self) -> int:
        return len(self.gpus) if self.accelerator != "cpu" else 1

    @property
    def bf16(self) -> bool:
        if self.accelerator == "cpu":
            return True  # DeepSpeed's CPU accelerator supports bf16; fp16 it does not
        return bool(self.gpus) and all(g.bf16 for g in self.gpus)

    @property
    def min_device_memory(self) -> int:
        if self.accelerator == "cpu" or not self.gpus:
            return self.host_memory
        return min(g.total_memory for g in self.gpus)

    def op(self, name: str) -> OpStatus | None:
        return next((o for o in self.ops if o.name == name), None)

    @property
    def nvme_offload_possible(self) -> bool | None:
        """DeepSpeed's NVMe offload needs the async_io op (libaio); None = not probed."""
        status = self.op("async_io")
        return None if status is None else status.loadable


def auto_precision(hardware: Hardware) -> str:
    """`ZT_MIXED_PRECISION=auto`: bf16 where every GPU has it, else fp16; fp32 on the CPU."""
    if hardware.accelerator == "cpu":
        return "no"  # DeepSpeed's CPU accelerator has no fp16, and bf16 is slow on most CPUs
    return "bf16" if hardware.bf16 else "fp16"


def cpu_only(host_memory: int = 16 * GiB, cpu_count: int = 2) -> Hardware:
    return Hardware(accelerator="cpu", host_memory=host_memory, cpu_count=cpu_count)


# --- facts: what probing found, before any decision -------------------------------------------


@dataclass(frozen=True)
class CudaDevice:
    """One device as torch.cuda numbers it (after CUDA_VISIBLE_DEVICES)."""

    index: int
    name: str
    total_memory: int
    compute_capability: tuple[int, int]
    uuid: str  # "GPU-..." as NVML spells it; "" when torch cannot tell


@dataclass(frozen=True)
class NvmlDevice:
    """One device as NVML sees it: every GPU of the host, whatever CUDA_VISIBLE_DEVICES says."""

    uuid: str
    name: str
    total_memory: int
    free_memory: int
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Facts:
    cuda: tuple[CudaDevice, ...] = ()
    nvml: tuple[NvmlDevice, ...] | None = None  # None: NVML not available
    hip: bool = False  # torch built for ROCm and a device is present
    mps: bool = False
    mem_total: int = 16 * GiB  # /proc/meminfo MemTotal
    cgroup_limit: int | None = None  # memory.max / memory.limit_in_bytes; None = unlimited
    cpu_count: int = 1
    shm_bytes: int | None = None
    memlock_bytes: int | None = None  # None = unlimited
    environ: dict[str, str] = field(default_factory=dict)  # the NVIDIA_* variables only
    ops: tuple[OpStatus, ...] = ()
    libaio: bool | None = None
    driver: Driver | None = None  # NVML's driver, probed even when CUDA cannot start
    image_cuda: tuple[int, int] | None = None  # torch.version.cuda
    cuda_error: str | None = None  # why PyTorch could not start CUDA, when it said so


# --- decisions (pure) -------------------------------------------------------------------------


def choose_accelerator(device_setting: str, facts: Facts) -> Accelerator:
    """ZT_DEVICE=auto picks CUDA when a GPU is visible; ROCm and MPS are named, not run."""
    if device_setting == "cpu":
        return "cpu"
    if facts.hip:
        return "rocm"
    if facts.cuda:
        return "cuda"
    if facts.mps:
        return "mps"
    if device_setting == "cuda":
        raise EnvironmentUnfit(
            "ZT_DEVICE=cuda: no CUDA GPU is visible; run with `docker run --gpus all` (and "
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility) or set ZT_DEVICE=auto/cpu"
        )
    if device_setting not in ("auto", "cuda"):
        raise ConfigError(f"ZT_DEVICE={device_setting!r}: expected auto, cuda or cpu")
    return "cpu"


def join_gpus(cuda: tuple[CudaDevice, ...], nvml: tuple[NvmlDevice, ...] | None) -> tuple[GPU, ...]:
    """torch's numbering with NVML's live numbers, matched by UUID (never by index).

    NVML ignores CUDA_VISIBLE_DEVICES, so NVML index 0 may be a GPU this container cannot use.
    Without a UUID match the free memory is unknown and taken as the total.
    """
    by_uuid = {d.uuid: d for d in nvml or ()}
    gpus = []
    for dev in cuda:
        seen = by_uuid.get(dev.uuid) if dev.uuid else None
        gpus.append(
            GPU(
                index=dev.index,
                name=dev.name,
                total_memory=dev.total_memory,
                free_memory=seen.free_memory if seen else dev.total_memory,
                compute_capability=dev.compute_capability,
                uuid=dev.uuid,
                pci_bus_id=seen.pci_bus_id if seen else "",
            )
        )
    return tuple(gpus)


def host_memory(mem_total: int, cgroup_limit: int | None) -> int:
    """The container's share: a cgroup limit below MemTotal is what the OOM killer enforces."""
    if cgroup_limit is not None and 0 < cgroup_limit < mem_total:
        return cgroup_limit
    return mem_total


def diagnose(facts: Facts, accelerator: Accelerator, gpus: tuple[GPU, ...]) -> list[str]:
    """Findings that will hurt training, each with the fix."""
    out: list[str] = []
    gpu_job = accelerator == "cuda" or bool(facts.environ.get("NVIDIA_VISIBLE_DEVICES"))
    if facts.shm_bytes is not None and facts.shm_bytes < MIN_SHM:
        out.append(
            f"/dev/shm is {facts.shm_bytes // MiB} MiB: NCCL and DataLoader workers need more; "
            "run with `--shm-size=16g` (docker), `ipc: host` (compose) or mount an emptyDir "
            "with medium: Memory at /dev/shm (Kubernetes)"
        )
    if accelerator == "cuda" and facts.memlock_bytes is not None and facts.memlock_bytes < GiB:
        out.append(
            f"ulimit -l is {facts.memlock_bytes // 1024} KiB: pinned host buffers for offload "
            "count against it; run with `--ulimit memlock=-1` (docker) or "
            "`ulimits: {memlock: -1}` (compose)"
        )
    caps = facts.environ.get("NVIDIA_DRIVER_CAPABILITIES")
    if gpu_job and caps is not None:
        have = {c.strip() for c in caps.split(",")}
        missing = [c for c in ("compute", "utility") if c not in have and "all" not in have]
        if missing:
            out.append(
                f"NVIDIA_DRIVER_CAPABILITIES={caps} lacks {','.join(missing)}: CUDA needs compute, "
                "NVML (memory metrics, GPU UUIDs) needs utility; set "
                "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
            )
    if accelerator == "cuda" and facts.nvml is None:
        out.append(
            "NVML is not available: free memory and GPU UUIDs are unknown (metrics cannot join "
            "DCGM); include `utility` in NVIDIA_DRIVER_CAPABILITIES"
        )
    for gpu in gpus:
        if gpu.free_memory < 0.9 * gpu.total_memory:
            used = (gpu.total_memory - gpu.free_memory) / GiB
            out.append(
                f"GPU {gpu.index} ({gpu.name}) already has {used:.1f} GiB in use by other "
                "processes: the plan assumes the whole GPU"
            )
    for op in facts.ops:
        if op.name == "async_io" and not op.loadable:
            out.append(
                "DeepSpeed async_io cannot load (libaio missing): NVMe offload is unavailable; "
                "install libaio-dev (the image has it) or offload to cpu"
            )
        elif op.name == "cpu_adam" and not op.loadable:
            out.append(
                "DeepSpeed cpu_adam cannot load: CPU optimizer offload is unavailable; "
                "install a C++ compiler and ninja, or prebuild with DS_BUILD_CPU_ADAM=1"
            )
        elif op.compatible and not op.prebuilt and op.jit_possible and accelerator == "cuda":
            out.append(
                f"DeepSpeed {op.name} is not prebuilt: it compiles at first use (minutes); "
                "build the image with DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_FUSED_ADAM=1"
            )
    return out


def describe(facts: Facts, device_setting: str = "auto") -> Hardware:
    """Raises EnvironmentUnfit (exit 3) when the host's GPUs cannot run this image's CUDA:
    a GPU host must not fall back to the CPU unasked."""
    if device_setting != "cpu":
        problem = driver_problem(
            facts.driver,
            facts.image_cuda,
            torch_sees_gpus=bool(facts.cuda),
            cuda_error=facts.cuda_error,
        )
        if problem:
            raise EnvironmentUnfit(problem)
    accelerator = choose_accelerator(device_setting, facts)
    gpus = join_gpus(facts.cuda, facts.nvml) if accelerator == "cuda" else ()
    found = diagnose(facts, accelerator, gpus)
    if accelerator == "cuda":
        found += driver_warnings(facts.driver, facts.image_cuda, torch_sees_gpus=True)
    return Hardware(
        accelerator=accelerator,
        gpus=gpus,
        host_memory=host_memory(facts.mem_total, facts.cgroup_limit),
        cpu_count=facts.cpu_count,
        shm_bytes=facts.shm_bytes,
        memlock_bytes=facts.memlock_bytes,
        warnings=tuple(found),
        driver_capabilities=facts.environ.get("NVIDIA_DRIVER_CAPABILITIES"),
        ops=facts.ops,
        libaio=facts.libaio,
        driver=facts.driver if accelerator == "cuda" else None,
        image_cuda=facts.image_cuda if accelerator == "cuda" else None,
    )


def require_supported(hardware: Hardware) -> None:
    """DeepSpeed cannot train on ROCm builds of this image nor on Apple MPS: say so (exit 3)."""
    if hardware.accelerator == "rocm":
        raise EnvironmentUnfit(
            "ROCm GPU detected: this image's DeepSpeed is built for CUDA and cannot run on it; "
            "use an NVIDIA GPU, or ZT_DEVICE=cpu to train (slowly) on the CPU"
        )
    if hardware.accelerator == "mps":
        raise EnvironmentUnfit(
            "Apple MPS detected: DeepSpeed does not run on MPS; use ZT_DEVICE=cpu or an NVIDIA GPU"
        )


# --- probing (thin I/O) -----------------------------------------------------------------------


def describe_hardware(hardware: Hardware) -> str:
    """The machine in one line, as `plan`, `config` and `check` print it."""

    def gib(n: float) -> str:
        return f"{n / GiB:.1f}"

    if hardware.accelerator == "cpu":
        head = "CPU accelerator (no GPU)"
    else:
        names = sorted({g.name for g in hardware.gpus})
        head = f"{len(hardware.gpus)} x {', '.join(names)} {gib(hardware.min_device_memory)} GiB"
        head += " (bf16)" if hardware.bf16 else " (no bf16)"
        if hardware.driver or hardware.image_cuda:
            head += f"; {describe_driver(hardware.driver, hardware.image_cuda)}"
    return f"{head}; host {gib(hardware.host_memory)} GiB; {hardware.cpu_count} CPUs"
