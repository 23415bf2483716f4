"""Build DeepSpeed's JIT ops ahead of time, so the first training step does not pay for it.

On the CPU accelerator DeepSpeed compiles each op (cpu_adam, async_io, shm comm, ...) with
ninja and g++ the first time a run needs it: minutes on two cores. `make setup` calls
`python -m zerotuner.machine.ops` once so tests and the demo start warm; the CUDA image prebuilds
its ops at `docker build` time instead (DS_BUILD_* in the Dockerfile).
"""

from __future__ import annotations

import os
import sys
import time

# The ops a CPU run can touch: optimizers (with and without offload), NVMe swap, collectives.
CPU_OPS = (
    "CPUAdamBuilder",
    "FusedAdamBuilder",
    "CPUAdagradBuilder",
    "CPULionBuilder",
    "AsyncIOBuilder",
    "ShareMemCommBuilder",
    "PinMemoryBuilder",
)


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can read it.

    torch accepts arch-specific targets ("9.0a" for Hopper's wgmma, "10.0f"), and CUDA images set
    them; DeepSpeed 0.19 parses each entry as numbers and fails every CUDA op on the letter
    ("invalid literal for int() with base 10: '0a'", seen on an H200). Its ops use no
    arch-specific instructions, so the plain target builds them the same: "9.0a" -> "9.0".
    """
    entries = []
    for entry in value.replace(" ", ";").split(";"):
        number, plus, suffix = entry.strip().partition("+")
        number = number.rstrip("abcdefghijklmnopqrstuvwxyz")
        if number and (plain := number + plus + suffix) not in entries:
            entries.append(plain)
    return ";".join(entries)


def build(names: tuple[str, ...] = CPU_OPS) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    from deepspeed.accelerator import get_accelerator

    failed = 0
    for name in names:
        start = time.monotonic()
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{name}: not available here (skipped)", flush=True)
            continue
        try:
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - report every op, fail at the end
            failed += 1
            print(f"{name}: build failed: {error}", flush=True)
            continue
        print(f"{name}: ready ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(build())
