"""Probing this machine: thin I/O (torch.cuda, NVML, /proc, /sys, rlimits, DeepSpeed's op
builders) that fills `hardware.Facts`; every decision made from them is in hardware.py."""

from __future__ import annotations

import contextlib
import ctypes.util
import dataclasses
import os
import resource
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from zerotuner.machine.driver import cuda_init_error, image_cuda, probe_driver
from zerotuner.machine.hardware import CudaDevice, Facts, Hardware, NvmlDevice, OpStatus, describe

DS_OPS = ("cpu_adam", "async_io", "fused_adam")
_BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "async_io": "AsyncIOBuilder",
    "fused_adam": "FusedAdamBuilder",
}


def probe(device_setting: str = "auto", environ: Any = None, *, ops: bool = True) -> Hardware:
    """Look at this machine. `ops=False` skips importing DeepSpeed (seconds) for quick checks."""
    environ = os.environ if environ is None else environ
    return describe(probe_facts(device_setting, environ, ops=ops), device_setting)


def probe_facts(device_setting: str, environ: Any, *, ops: bool = True) -> Facts:
    gpu = device_setting != "cpu"
    cuda, hip, mps, cuda_error = _torch_devices() if gpu else ((), False, False, None)
    facts = Facts(
        cuda=cuda,
        nvml=_nvml_devices() if cuda and not hip else None,
        hip=hip,
        mps=mps,
        mem_total=_mem_total(),
        cgroup_limit=_cgroup_memory_limit(),
        cpu_count=_cpu_count(),
        shm_bytes=_fs_size("/dev/shm"),
        memlock_bytes=_memlock(),
        environ={k: v for k, v in environ.items() if k.startswith("NVIDIA_")},
        libaio=ctypes.util.find_library("aio") is not None,
        driver=probe_driver() if gpu and not hip else None,
        image_cuda=image_cuda() if gpu and not hip else None,
        cuda_error=cuda_error,
    )
    return with_ops(facts, environ) if ops else facts


def with_ops(facts: Facts, environ: Any) -> Facts:
    """`facts` (probed with ops=False) completed with DeepSpeed's op builders: the one part
    of the probe that imports DeepSpeed, so `train` places its ranks before asking it."""
    accelerator = "cuda" if facts.cuda and not facts.hip else "cpu"
    return dataclasses.replace(facts, ops=_ds_ops(accelerator, environ))


def _torch_devices() -> tuple[tuple[CudaDevice, ...], bool, bool, str | None]:
    import torch

    hip = bool(getattr(torch.version, "hip", None))
    devices = []
    # A driver too old for the wheel makes is_available() False with only a warning: keep why.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    cuda_error = None if available else cuda_init_error([str(w.message) for w in caught])
    if available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            uuid = str(getattr(props, "uuid", "") or "")
            if uuid and not uuid.startswith("GPU-"):
                uuid = f"GPU-{uuid}"  # torch prints the bare UUID; NVML prefixes it
            devices.append(
                CudaDevice(i, props.name, int(props.total_memory), (props.major, props.minor), uuid)
            )
    mps_backend = getattr(torch.backends, "mps", None)
    mps = bool(mps_backend and mps_backend.is_available())
    return tuple(devices), hip and bool(devices), mps, cuda_error


def _nvml_devices() -> tuple[NvmlDevice, ...] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver library, or `utility` capability missing
        return None
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            found.append(
                NvmlDevice(
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_memory=int(mem.total),
                    free_memory=int(mem.free),
                    pci_bus_id=_text(pci.busId),
                )
            )
        return tuple(found)
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 reports "unlimited" as ~2**63
            return int(text)
        return None
    return None


def _cpu_count() -> int:
    cpus = len(os.sched_getaffinity(0))
    try:  # cgroup v2 quota: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def _fs_size(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _memlock() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _ds_ops(accelerator: str, environ: Any) -> tuple[OpStatus, ...]:
    """Ask DeepSpeed's op builders (no compile): compatible, prebuilt, or JIT-compilable."""
    env_backup = os.environ.get("DS_ACCELERATOR")
    if accelerator == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # else DeepSpeed probes for CUDA and warns
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

        acc = get_accelerator()
        compiler = bool(shutil.which("c++") or shutil.which("g++"))
        jit = compiler and shutil.which("ninja") is not None
        if accelerator == "cuda":
            cuda_jit = jit and bool(shutil.which("nvcc") or environ.get("CUDA_HOME"))
        else:
            cuda_jit = jit
        found = []
        for name in DS_OPS:
            builder = acc.create_op_builder(_BUILDERS[name])
            # async_io's check compiles a test program with stderr dup'ed to a file: it needs a
            # real stderr descriptor, which captured streams (pytest, notebooks) lack.
            with contextlib.redirect_stderr(sys.__stderr__):
                compatible = bool(builder and builder.is_compatible(verbose=False))
            needs_cuda = name == "fused_adam"
            found.append(
                OpStatus(
                    name=name,
                    compatible=compatible,
                    prebuilt=bool(installed_ops.get(name)),
                    jit_possible=cuda_jit if needs_cuda else jit,
                )
            )
        return tuple(found)
    except Exception:  # an unusable DeepSpeed install is reported by train itself
        return ()
    finally:
        if accelerator == "cpu":
            if env_backup is None:
                os.environ.pop("DS_ACCELERATOR", None)
            else:
                os.environ["DS_ACCELERATOR"] = env_backup
