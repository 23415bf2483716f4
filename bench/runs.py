"""Running the two things compared: `zerotuner train` (the product) and bench.bare (by hand).

Both run as subprocesses with the same ranks, threads and DeepSpeed config. A product run
is timed from the moment its entrypoint process is spawned; its phases come from the
timestamps of its own log lines and steps.jsonl, so nothing in the product is instrumented
for the bench.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXIT_SIGNAL = 143  # zerotuner's exit after a graceful stop (SIGTERM)
BIN = Path(sys.executable).parent
TIMEOUT = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OMP_NUM_THREADS", None)  # zerotuner sets cores // ranks; the bare loop copies it
    return env


def zt_env(work: Path, model: Path, data: Path, *, steps: int, **settings: Any) -> dict[str, str]:
    """ZT_* for a bench run: no checkpoints, samples or metrics besides the final save."""
    env = {
        "ZT_DEVICE": "cpu",
        "ZT_MODEL": str(model),
        "ZT_DATA_DIR": str(data),
        "ZT_OUTPUT_DIR": str(work / "output"),
        "ZT_CACHE_DIR": str(work.parent / "cache"),  # shared: caching is timed on the first run
        "ZT_OFFLOAD_DIR": str(work / "offload"),
        "ZT_METRICS_PORT": "0",
        "ZT_NUM_PROCESSES": "2",
        "ZT_MIXED_PRECISION": "no",
        "ZT_RESOLUTION": "64",
        "ZT_TRAIN_BATCH_SIZE": "2",
        "ZT_MAX_STEPS": str(steps),
        "ZT_LEARNING_RATE": "1e-4",
        "ZT_CHECKPOINT_EVERY_STEPS": "0",
        "ZT_LOG_EVERY_STEPS": "1",
        "ZT_MASTER_PORT": str(free_port()),
    }
    env |= {f"ZT_{k.upper()}": str(v) for k, v in settings.items()}
    return env


class TreeMonitor(threading.Thread):
    """Calls `sample(processes)` every `every` seconds with a process and all its descendants,
    until `stop()` or the process is gone."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self._done = threading.Event()

    def sample(self, procs: list) -> None:
        raise NotImplementedError

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            self.sample(procs)
            self._done.wait(self.every)

    def stop(self) -> None:
        self._done.set()
        self.join()


class IoMonitor(TreeMonitor):
    """Samples the read/write bytes of a process tree (the ranks' swap I/O is O_DIRECT, so it
    shows in /proc/PID/io as block I/O) with a wall-clock timestamp."""

    def __init__(self, pid: int, every: float = 0.25, disk: str | None = None) -> None:
        super().__init__(pid, every)
        self.disk = disk
        self.samples: list[tuple[float, int, int]] = []
        self.busy: list[tuple[float, int]] = []  # (time, the disk's busy milliseconds)
        self._last: dict[int, tuple[int, int]] = {}

    def sample(self, procs: list) -> None:
        import psutil

        for proc in procs:
            try:
                io = proc.io_counters()
                self._last[proc.pid] = (io.read_bytes, io.write_bytes)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # an exited process keeps its last sample
        read = sum(r for r, _ in self._last.values())
        written = sum(w for _, w in self._last.values())
        self.samples.append((time.time(), read, written))
        if self.disk:
            counters = psutil.disk_io_counters(perdisk=True).get(self.disk)
            if counters is not None:
                self.busy.append((time.time(), counters.busy_time))

    def between(self, start: float, end: float) -> tuple[int, int]:
        """(read, written) bytes between two wall-clock times (nearest samples)."""

        def at(t: float) -> tuple[int, int]:
            best = min(self.samples, key=lambda s: abs(s[0] - t))
            return best[1], best[2]

        (r0, w0), (r1, w1) = at(start), at(end)
        return r1 - r0, w1 - w0

    def busy_seconds(self, start: float, end: float) -> float | None:
        """Seconds the disk was busy between two times (any process: a shared machine)."""
        if not self.busy:
            return None

        def at(t: float) -> int:
            return min(self.busy, key=lambda s: abs(s[0] - t))[1]

        return (at(end) - at(start)) / 1000


class MemoryMonitor(TreeMonitor):
    """Samples the memory of a process tree: the peak of the summed RSS and of the summed PSS
    (shared library pages counted once across the processes, as the host pays them), and
    each process's own peak RSS by its command line."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        super().__init__(pid, every)
        self.peak_rss = self.peak_pss = 0
        self.per_process: dict[int, tuple[str, int]] = {}  # pid -> (command, peak RSS)

    def sample(self, procs: list) -> None:
        import psutil

        rss = pss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
                command = " ".join(proc.cmdline()[1:4])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, pss = rss + info.rss, pss + info.pss
            old = self.per_process.get(proc.pid, ("", 0))[1]
            self.per_process[proc.pid] = (command, max(old, info.rss))
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)


def disk_of(path: Path) -> str | None:
    """The block device name (as in /proc/diskstats) holding `path`."""
    st = os.stat(path)
    uevent = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/uevent")
    if not uevent.exists():
        return None
    for line in uevent.read_text().splitlines():
        if line.startswith("DEVNAME="):
            return line.split("=", 1)[1]
    return None


@dataclass
class ProductRun:
    spawned: float
    ended: float
    code: int
    log: str
    steps: list[dict]
    deepspeed: dict
    io: IoMonitor | None = None
    memory: MemoryMonitor | None = None
    marks: dict[str, float] = field(default_factory=dict)
    signalled: float | None = None  # when SIGTERM was sent (stop_after)


MARKS = {  # log text -> the moment it marks (the first line containing it)
    "zerotuner.train: plan:": "planned",
    "launching ": "launching",
    "phase: loading": "loading",
    "phase: caching": "caching",
    "zerotuner.train.worker: cache:": "cached",  # then engine init until step 1 starts
}


def run_product(
    work: Path,
    env: dict[str, str],
    *,
    disk: str | None = None,
    monitor_io: bool = False,
    monitor_memory: bool = False,
    stop_after: int | None = None,
    stop_delay: float = 0.0,
    check: bool = True,
) -> ProductRun:
    """`zerotuner train` as a user runs it (the console script), to the end; or, with
    `stop_after`, SIGTERM `stop_delay` seconds after that many steps are in steps.jsonl (the
    product's graceful stop: a committed checkpoint and exit 143, no final export). Raises on
    any other exit code unless `check` is false."""
    work.mkdir(parents=True, exist_ok=True)
    full = base_env() | env
    spawned = time.time()
    proc = subprocess.Popen(
        [str(BIN / "zerotuner"), "train"], env=full, cwd=work,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    io = IoMonitor(proc.pid, disk=disk) if monitor_io else None
    if io:
        io.start()
    memory = MemoryMonitor(proc.pid) if monitor_memory else None
    if memory:
        memory.start()
    signalled: dict[str, float] = {}
    if stop_after:
        output = Path(env["ZT_OUTPUT_DIR"])
        threading.Thread(
            target=_stop_after, args=(proc, output, stop_after, stop_delay, signalled), daemon=True
        ).start()
    out, _ = proc.communicate(timeout=TIMEOUT)
    ended = time.time()
    if io:
        io.stop()
    if memory:
        memory.stop()
    (work / "train.log").write_text(out)
    output = Path(env["ZT_OUTPUT_DIR"])
    steps_file = output / "run" / "steps.jsonl"
    steps = (
        [json.loads(x) for x in steps_file.read_text().splitlines()] if steps_file.exists() else []
    )
    ds_file = output / "run" / "deepspeed.json"
    ds = json.loads(ds_file.read_text()) if ds_file.exists() else {}
    run = ProductRun(spawned, ended, proc.returncode, out, steps, ds, io, memory)
    run.marks = log_marks(out)
    run.signalled = signalled.get("at")
    if check and proc.returncode != (EXIT_SIGNAL if stop_after else 0):
        raise RuntimeError(f"zerotuner train exited {proc.returncode}; log in {work}/train.log")
    return run


def _stop_after(
    proc: subprocess.Popen, output: Path, steps: int, delay: float, signalled: dict
) -> None:
    steps_file = output / "run" / "steps.jsonl"
    while proc.poll() is None:
        if steps_file.exists() and len(steps_file.read_text().splitlines()) >= steps:
            time.sleep(delay)
            if proc.poll() is None:
                signalled["at"] = time.time()
                proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.2)


def log_marks(log: str) -> dict[str, float]:
    """Wall-clock times of the first log line holding each MARKS text."""
    marks: dict[str, float] = {}
    for line in log.splitlines():
        for text, name in MARKS.items():
            if name not in marks and text in line:
                try:
                    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                except ValueError:
                    continue
                marks[name] = stamp.timestamp()
    return marks


@dataclass
class BareRun:
    spawned: float
    ranks: list[dict]

    @property
    def rank0(self) -> dict:
        return self.ranks[0]


def run_bare(
    work: Path,
    model: Path,
    config: dict,
    *,
    steps: int,
    world: int = 2,
    threads: int | None = None,
    lora_rank: int = 0,
) -> BareRun:
    """bench.bare under torchrun: `world` CPU ranks, `threads` each (zerotuner's default);
    with `lora_rank`, a LoRA adapter on the default targets trains instead of the UNet."""
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "deepspeed.json"
    config_file.write_text(json.dumps(config, indent=2))
    out = work / "ranks"
    env = base_env()
    env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // world))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
        f"--master_port={free_port()}", "-m", "bench.bare", "--model", str(model),
        "--config", str(config_file), "--steps", str(steps), "--out", str(out),
        "--lora-rank", str(lora_rank),
    ]  # fmt: skip
    spawned = time.time()
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    (work / "bare.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"bare loop exited {done.returncode}; log in {work}/bare.log")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    return BareRun(spawned, ranks)
