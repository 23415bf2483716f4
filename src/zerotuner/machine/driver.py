"""The NVIDIA driver floor: can this host's driver run the CUDA this image's PyTorch is built for?

One fact decides it: the CUDA version of the installed PyTorch wheel (`torch.version.cuda`; 13.0
in the default image, 12.8 in the CUDA 12 build, and the Dockerfile fails the build if the wheel
and the base image disagree). The minimum driver follows from its major by NVIDIA's table of
minor-version compatibility (docs.nvidia.com/deploy/cuda-compatibility, Table 1, Linux): a
program built with any CUDA 12.x runs on any driver >= 525.60.13, any 13.x on any driver >= 580.
A newer minor than the driver's own only loses PTX JIT, which the image's prebuilt kernels do
not need. The driver's version comes from NVML, which answers even when CUDA cannot start.

Below the floor NVIDIA's container runtime usually refuses the container before zerotuner runs
(the image's NVIDIA_REQUIRE_CUDA); this check is for when it does not: NVIDIA_DISABLE_REQUIRE=1,
runtimes that skip the check, or a data-centre GPU whose forward-compatibility path failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# CUDA major -> the oldest Linux driver that runs every minor of it (NVIDIA's table).
MIN_DRIVER: dict[int, tuple[int, ...]] = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580,)}
# The documented second image, for hosts with a CUDA 12 driver (docs/deploy.md "One GPU host").
CUDA12_BUILD = "docker build --build-arg CUDA_VERSION=12.8.1 -t zerotuner:cuda12 ."


@dataclass(frozen=True)
class Driver:
    """The host's NVIDIA driver as NVML reports it."""

    version: str  # "550.54.15"
    cuda: tuple[int, int] | None = None  # the newest CUDA it runs, e.g. (12, 4)
    gpus: int = 0  # every GPU of the host NVML sees, whatever CUDA_VISIBLE_DEVICES says


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """'13.0' -> (13, 0); None (a CPU build of PyTorch) stays None."""
    parts = version_tuple(text or "")
    return (parts[0], parts[1] if len(parts) > 1 else 0) if parts else None


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(p) if i == 0 else f"{p:02d}" for i, p in enumerate(version))


def min_driver(image_cuda: tuple[int, int]) -> tuple[int, ...] | None:
    return MIN_DRIVER.get(image_cuda[0])


def driver_runs(driver: Driver, image_cuda: tuple[int, int]) -> bool:
    floor = min_driver(image_cuda)
    if floor is not None:
        return version_tuple(driver.version) >= floor
    # A CUDA major newer than the table: the driver must report that major itself.
    return driver.cuda is not None and driver.cuda[0] >= image_cuda[0]


def _cuda_text(cuda: tuple[int, int] | None) -> str:
    return f"{cuda[0]}.{cuda[1]}" if cuda else "?"


def driver_problem(
    driver: Driver | None,
    image_cuda: tuple[int, int] | None,
    *,
    torch_sees_gpus: bool,
    cuda_error: str | None = None,
) -> str | None:
    """The one line that ends the job (exit 3), or None. Only when PyTorch found no GPU: one it
    found works, whatever NVML says (forward compatibility on a data-centre GPU)."""
    if driver is None or image_cuda is None or torch_sees_gpus or driver.gpus == 0:
        return None
    need = _cuda_text(image_cuda)
    if not driver_runs(driver, image_cuda):
        floor = min_driver(image_cuda)
        at_least = f"driver >= {dotted(floor)}" if floor else f"a driver for CUDA {need}"
        fixes = f"use a host whose driver is >= {dotted(floor)}" if floor else "use a newer host"
        if image_cuda[0] > 12 and driver_runs(driver, (12, 0)):
            fixes += f", or the CUDA 12 image ({CUDA12_BUILD})"
        # With forward-compatibility libraries loaded NVML may report their CUDA, not the driver's.
        if driver.cuda is not None and driver.cuda < image_cuda:
            head = f"NVIDIA driver {driver.version} supports CUDA up to {_cuda_text(driver.cuda)}"
        else:
            head = f"NVIDIA driver {driver.version} is too old"
        return f"{head}; this image's PyTorch is built for CUDA {need} ({at_least}): {fixes}"
    if cuda_error:
        return (
            f"NVML sees {driver.gpus} GPU(s) with driver {driver.version} (CUDA "
            f"{_cuda_text(driver.cuda)}), but PyTorch (CUDA {need}) cannot start CUDA: "
            f"{cuda_error}; set ZT_DEVICE=cpu to train on the CPU on purpose"
        )
    return None


def driver_warnings(
    driver: Driver | None, image_cuda: tuple[int, int] | None, *, torch_sees_gpus: bool
) -> list[str]:
    """A driver older than the wheel's CUDA that still runs it: say how, once."""
    if driver is None or image_cuda is None or not torch_sees_gpus or driver.cuda is None:
        return []
    if driver.cuda >= image_cuda:
        return []
    need = _cuda_text(image_cuda)
    if driver.cuda[0] == image_cuda[0]:
        how = "CUDA minor-version compatibility (no PTX JIT for GPUs newer than the image's list)"
    else:
        how = "CUDA forward compatibility (data-centre GPUs only)"
    return [
        f"NVIDIA driver {driver.version} supports CUDA {_cuda_text(driver.cuda)}, older than "
        f"the image's CUDA {need}: running on {how}"
    ]


def describe_driver(driver: Driver | None, image_cuda: tuple[int, int] | None) -> str:
    """'driver 580.65.06 (CUDA 13.0), PyTorch for CUDA 13.0' for the hardware line."""
    parts = []
    if driver is not None:
        parts.append(f"NVIDIA driver {driver.version} (CUDA {_cuda_text(driver.cuda)})")
    if image_cuda is not None:
        parts.append(f"PyTorch for CUDA {_cuda_text(image_cuda)}")
    return ", ".join(parts)


# --- probing (thin I/O) -----------------------------------------------------------------------


def probe_driver() -> Driver | None:
    """NVML's view of the driver; None without NVML (no driver mounted, or no `utility`)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        version = _text(pynvml.nvmlSystemGetDriverVersion())
        try:  # 1000 * major + 10 * minor, e.g. 12040
            raw = int(pynvml.nvmlSystemGetCudaDriverVersion())
            cuda: tuple[int, int] | None = (raw // 1000, raw % 1000 // 10)
        except Exception:
            cuda = None
        return Driver(version=version, cuda=cuda, gpus=int(pynvml.nvmlDeviceGetCount()))
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def image_cuda() -> tuple[int, int] | None:
    """The CUDA this PyTorch wheel is built for; None for a CPU or ROCm build."""
    import torch

    return cuda_version(getattr(torch.version, "cuda", None))


def cuda_init_error(messages: list[str]) -> str | None:
    """PyTorch's 'CUDA initialization: ...' warning, trimmed to its reason."""
    for message in messages:
        if "CUDA initialization" in message or "cudaGetDeviceCount" in message:
            text = message.split("(Triggered internally", 1)[0]
            text = text.replace("CUDA initialization:", "").strip().rstrip(".")
            return " ".join(text.split())[:300]
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
