"""What the machine offers: the description every decision is made from.

Probing (torch.cuda, NVML, /proc, /sys) fills these dataclasses; everything downstream (plan,
normalize) takes them as plain data so its decisions are tested by feeding descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Accelerator = Literal["cuda", "cpu", "rocm", "mps"]

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_memory: int  # bytes
    free_memory: int  # bytes
    compute_capability: tuple[int, int] = (8, 0)
    uuid: str = ""

    @property
    def bf16(self) -> bool:
        return self.compute_capability >= (8, 0)  # Ampere and newer


@dataclass(frozen=True)
class Hardware:
    accelerator: Accelerator
    gpus: tuple[GPU, ...] = ()
    host_memory: int = 16 * GiB  # bytes of RAM available to this container
    cpu_count: int = 1
    shm_bytes: int | None = None
    memlock_bytes: int | None = None  # None = unlimited
    warnings: tuple[str, ...] = field(default_factory=tuple)

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


def cpu_only(host_memory: int = 16 * GiB, cpu_count: int = 2) -> Hardware:
    return Hardware(accelerator="cpu", host_memory=host_memory, cpu_count=cpu_count)
