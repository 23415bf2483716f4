"""What the offload directory's disk can do: raw O_DIRECT sequential throughput (dd) and
DeepSpeed's own async I/O handle swept over the `aio` settings the normalizer fills in."""

from __future__ import annotations

import itertools
import re
import subprocess
import time
from pathlib import Path

MiB = 1 << 20
GRID = {
    "block_size": (256 * 1024, 1 << 20, 4 << 20),
    "queue_depth": (8, 32, 128),
    "intra_op_parallelism": (1, 2),
}


def _dd_seconds(args: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - started
    match = re.search(r"copied, ([0-9.]+) s", done.stderr)
    return float(match.group(1)) if match else elapsed


def dd_throughput(folder: Path, mib: int) -> dict[str, float]:
    """Sequential 1 MiB O_DIRECT write (with the final fsync) then read; bytes per second."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench-dd.bin"
    try:
        write = _dd_seconds([
            "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync",
        ])  # fmt: skip
        read = _dd_seconds([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": mib * MiB, "write_bytes_per_s": mib * MiB / write,
            "read_bytes_per_s": mib * MiB / read}  # fmt: skip


def aio_sweep(folder: Path, mib: int, grid: dict = GRID) -> list[dict]:
    """DeepSpeed's aio_handle: one page-locked buffer written to and read from one file, per
    (block_size, queue_depth, intra_op_parallelism); as the swappers use it."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    folder.mkdir(parents=True, exist_ok=True)
    path = str(folder / "bench-aio.bin")
    numel = mib * MiB // 4
    rows = []
    try:
        for block, depth, parallel in itertools.product(*grid.values()):
            handle = aio.aio_handle(block, depth, False, True, parallel)
            buffer = handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
            buffer.uniform_()
            started = time.perf_counter()
            assert handle.sync_pwrite(buffer, path) != -1
            write = time.perf_counter() - started
            started = time.perf_counter()
            assert handle.sync_pread(buffer, path) != -1
            read = time.perf_counter() - started
            handle.free_cpu_locked_tensor(buffer)
            rows.append({
                "block_size": block, "queue_depth": depth, "intra_op_parallelism": parallel,
                "write_bytes_per_s": numel * 4 / write, "read_bytes_per_s": numel * 4 / read,
            })  # fmt: skip
    finally:
        Path(path).unlink(missing_ok=True)
    return rows


def best_aio(rows: list[dict]) -> dict:
    """The settings with the best harmonic mean of read and write (swaps do both per step)."""

    def score(r: dict) -> float:
        return 2 / (1 / r["read_bytes_per_s"] + 1 / r["write_bytes_per_s"])

    best = max(rows, key=score)
    return {k: best[k] for k in GRID} | {"harmonic_bytes_per_s": score(best)}
