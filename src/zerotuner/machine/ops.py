"""Build DeepSpeed's JIT ops ahead of time, so the first training step does not pay for it.

On the CPU accelerator DeepSpeed compiles each op (cpu_adam, async_io, shm comm, ...) with
ninja and g++ the first time a run needs it: minutes on two cores. `make setup` calls
`python -m zerotuner.machine.ops` once so tests and the demo start warm; the CUDA image prebuilds
its ops at `docker build` time instead (DS_BUILD_* in the Dockerfile).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

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


# torch builds an op in TORCH_EXTENSIONS_DIR/[pyXY_cuZ/]NAME and holds a FileBaton there: a
# `lock` file that every other build waits on, without a word or a bound, until it is gone. A
# start killed mid-build (docker stop, eviction) leaves it behind for good.
QUIET_SECONDS = 60.0  # a live build writes into its folder at least this often
WAIT_SECONDS = 1800.0  # the longest a start waits on a live build before leaving it to torch


def extensions_root(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where torch JIT-builds ops (torch.utils.cpp_extension's default, without importing it)."""
    default = Path("~/.cache/torch_extensions").expanduser()
    return Path(environ.get("TORCH_EXTENSIONS_DIR") or default)


def _building(folder: Path, quiet_seconds: float) -> bool:
    """Whether a build works in `folder`: a process of this machine runs there (ninja and the
    compiler do), or a file in it changed within `quiet_seconds` (one on another node sharing
    the cache, or between ninja and loading the op)."""
    import psutil

    for process in psutil.process_iter(["cwd"]):
        if process.info["cwd"] and Path(process.info["cwd"]) == folder:
            return True
    try:
        newest = max(p.stat().st_mtime for p in folder.iterdir())
    except (OSError, ValueError):
        return False
    return time.time() - newest < quiet_seconds


def clear_stale_locks(
    root: Path | None = None,
    *,
    quiet_seconds: float = QUIET_SECONDS,
    wait_seconds: float = WAIT_SECONDS,
    poll: float = 1.0,
) -> list[Path]:
    """Remove each op build's `lock` that no live build holds, one line each; wait (saying so,
    at most `wait_seconds`) on one that a build holds. Returns the locks removed."""
    root = extensions_root() if root is None else root
    removed: list[Path] = []
    try:
        locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    except OSError:
        return removed
    deadline = time.monotonic() + wait_seconds
    for lock in locks:
        said = False
        while lock.exists() and _building(lock.parent, quiet_seconds):
            if time.monotonic() > deadline:
                log.warning("%s: still held by a build after %.0f s; the ranks wait on it",
                            lock, wait_seconds)  # fmt: skip
                break
            if not said:
                log.info("waiting for the DeepSpeed op build holding %s (at most %.0f s)",
                         lock, wait_seconds)  # fmt: skip
                said = True
            time.sleep(poll)
        else:
            try:
                lock.unlink()
            except FileNotFoundError:
                continue  # its build finished
            except OSError as exc:
                log.warning("%s: a stale build lock that cannot be removed (%s): the op's "
                            "build would wait on it forever; remove it by hand", lock,
                            exc.strerror)  # fmt: skip
                continue
            log.warning("removed a stale lock of an interrupted DeepSpeed op build: %s "
                        "(no build has touched that folder for %.0f s)", lock,
                        quiet_seconds)  # fmt: skip
            removed.append(lock)
    return removed


def build(names: tuple[str, ...] = CPU_OPS) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    clear_stale_locks()
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
