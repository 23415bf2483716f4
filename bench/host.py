"""The machine a bench ran on, and how busy it was: recorded with every result."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from zerotuner.machine.hardware import GiB


def machine() -> dict[str, Any]:
    import deepspeed
    import diffusers
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor(),
    )  # fmt: skip
    mem = next(
        int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        # the vector ISA torch's CPU kernels use (AVX2, AVX512): hosts differ between sessions
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ram_gib": round(mem / GiB, 1),
        "gpu": None,
        "accelerator": "DeepSpeed CPU accelerator (gloo)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "diffusers": diffusers.__version__,
        "kernel": platform.release(),
    }


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
