"""Launching the ranks: topology, the torchrun command line, the worker environment, signals.

One entrypoint runs per node. It works out where it sits in the job (explicit `ZT_*`
settings, else Kubeflow's `PET_*`, else an Indexed Job's completion index, else one node),
starts torchrun in its own process group, forwards SIGTERM/SIGINT so ranks can checkpoint,
and maps the outcome to the public exit codes from the statuses the ranks wrote (torchrun
itself exits 1 for every kind of failure). torchrun runs as `zerotuner.launch.torchrun`, which
ends a requested stop without torchrun's traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import (
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_SIGNAL,
    ConfigError,
    StoppedBeforeStart,
)
from zerotuner.launch.job import JOB_FILE_ENV, LAUNCHER_PID_ENV
from zerotuner.launch.records import STATUS_DIR_ENV, read_armed_ranks, read_rank_statuses
from zerotuner.machine.hardware import Hardware
from zerotuner.machine.ops import deepspeed_arch_list

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    source: str  # where the node values came from, for the log

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _int(value: Any, name: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a whole number") from None


def _nnodes(value: str, name: str) -> int:
    """Kubeflow may write an elastic range "min:max"; static rendezvous needs one number."""
    if ":" in value:
        low, high = (_int(v, name) for v in value.split(":", 1))
        if low != high:
            raise ConfigError(
                f"{name}={value}: elastic node ranges are not supported; give a fixed count "
                "(or set ZT_NNODES)"
            )
        return low
    return _int(value, name)


def resolve_topology(
    settings: Any, hardware: Hardware, environ: Mapping[str, str], *, rendezvous: bool = True
) -> Topology:
    """Each value from the first source that has it: ZT_* settings, PET_*, Indexed Job, defaults.

    Kubeflow's own RANK/WORLD_SIZE count nodes, not processes: they are ignored (torchrun sets
    the per-process values for the ranks). `rendezvous=False` (`plan`, `config`: only the world
    size matters) lets a multi-node job without ZT_MASTER_ADDR through, with a placeholder.
    """
    sources = []
    pet = {k: v for k, v in environ.items() if k.startswith("PET_") and v.strip()}
    index = environ.get("JOB_COMPLETION_INDEX", "").strip()

    if settings.nnodes is not None:
        nnodes, sources = settings.nnodes, ["ZT_NNODES"]
    elif "PET_NNODES" in pet:
        nnodes, sources = _nnodes(pet["PET_NNODES"], "PET_NNODES"), ["PET_*"]
    else:
        nnodes = 1

    if settings.node_rank is not None:
        node_rank = settings.node_rank
        sources.append("ZT_NODE_RANK")
    elif "PET_NODE_RANK" in pet:
        node_rank = _int(pet["PET_NODE_RANK"], "PET_NODE_RANK")
    elif index:
        node_rank = _int(index, "JOB_COMPLETION_INDEX")
        sources.append("JOB_COMPLETION_INDEX")
        if nnodes == 1 and node_rank > 0:
            raise ConfigError(
                f"JOB_COMPLETION_INDEX={index} but ZT_NNODES is not set: an Indexed Job must "
                "set ZT_NNODES to its completions"
            )
    else:
        node_rank = 0

    master_addr = settings.master_addr or pet.get("PET_MASTER_ADDR")
    if master_addr is None:
        if nnodes > 1 and rendezvous:
            raise ConfigError(
                f"{nnodes} nodes need ZT_MASTER_ADDR (the host of node 0, e.g. "
                "<job>-0.<service> for an Indexed Job with a headless Service)"
            )
        master_addr = LOCALHOST
    if settings.master_port is not None:
        master_port = settings.master_port
    elif "PET_MASTER_PORT" in pet:
        master_port = _int(pet["PET_MASTER_PORT"], "PET_MASTER_PORT")
    else:
        # One node: 0 = a free port chosen at launch, so two jobs on one host (tests, host
        # networking) never collide on 29500.
        master_port = DEFAULT_MASTER_PORT if nnodes > 1 else 0

    if settings.num_processes is not None:
        nproc = settings.num_processes
    elif pet.get("PET_NPROC_PER_NODE", "").isdigit():  # it may also say "auto" or "gpu"
        nproc = int(pet["PET_NPROC_PER_NODE"])
    else:
        nproc = hardware.device_count if hardware.accelerator != "cpu" else 1
    if hardware.accelerator == "cuda" and nproc > len(hardware.gpus):
        raise ConfigError(
            f"{nproc} ranks per node but only {len(hardware.gpus)} GPUs are visible: lower "
            "ZT_NUM_PROCESSES or expose more GPUs (--gpus all, CUDA_VISIBLE_DEVICES)"
        )
    if nproc < 1:
        raise ConfigError(f"ranks per node = {nproc}: no GPU visible; set ZT_DEVICE=cpu")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node rank {node_rank} is outside 0..{nnodes - 1} (ZT_NNODES={nnodes})")
    source = ", ".join(dict.fromkeys(sources)) or "single node"
    return Topology(nnodes, node_rank, nproc, master_addr, master_port, source)


def free_port(host: str = LOCALHOST) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def torchrun_command(
    topology: Topology,
    *,
    module: str = "zerotuner.train.worker",
    shutdown_timeout: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """torchrun (`zerotuner.launch.torchrun`: no traceback on a requested stop) with a static
    rendezvous at node 0.

    `shutdown_timeout`: seconds torchrun lets ranks finish after SIGTERM before SIGKILL (its
    default is 30, too short to save an SDXL checkpoint).
    """
    argv = [
        python,
        "-m",
        "zerotuner.launch.torchrun",
        f"--nnodes={topology.nnodes}",
        f"--node-rank={topology.node_rank}",
        f"--nproc-per-node={topology.nproc_per_node}",
        f"--master-addr={topology.master_addr}",
        f"--master-port={topology.master_port}",
        "--rdzv-backend=static",
        "--max-restarts=0",  # retries belong to the orchestrator, which sees our exit code
    ]
    if shutdown_timeout is not None:
        argv.append(f"--shutdown-timeout={int(shutdown_timeout)}")
    return [*argv, "-m", module]


def worker_env(
    base_env: Mapping[str, str],
    topology: Topology,
    hardware: Hardware,
    *,
    job_file: Path | str,
    status_dir: Path | str,
) -> dict[str, str]:
    """The ranks' environment, set deliberately rather than inherited by accident."""
    env = dict(base_env)
    # A rank whose peer died raises instead of hanging in a collective forever.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # torch numbers GPUs by speed otherwise; nvidia-smi, NVML and DCGM by PCI bus.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # torchrun sets 1 thread per rank when unset; give each rank its share of the CPUs.
    env.setdefault("OMP_NUM_THREADS", str(max(1, hardware.cpu_count // topology.nproc_per_node)))
    if hardware.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    elif hardware.accelerator == "cuda":
        env.setdefault("DS_ACCELERATOR", "cuda")
        if env.get("TORCH_CUDA_ARCH_LIST"):  # a rank JIT-builds the ops the image lacks
            env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[JOB_FILE_ENV] = str(job_file)
    env[STATUS_DIR_ENV] = str(status_dir)
    return env


def exit_code(torchrun_code: int, statuses: list[Any], *, signalled: bool) -> int:
    """The public exit code from torchrun's and the ranks' own reports."""
    codes = [s.exit_code for s in statuses]
    if EXIT_CONFIG in codes:
        return EXIT_CONFIG
    if EXIT_ENVIRONMENT in codes:
        return EXIT_ENVIRONMENT
    if EXIT_DIVERGED in codes:  # every rank decides alike; one saying so is enough
        return EXIT_DIVERGED
    if signalled and codes and all(c == EXIT_SIGNAL for c in codes):
        return EXIT_SIGNAL
    # another node was lost: retry every node; a rank of this node that failed on its own
    # (1) makes it this node's failure
    if EXIT_PEER_LOST in codes and EXIT_FAILURE not in codes:
        return EXIT_PEER_LOST
    if torchrun_code == 0 and all(c == EXIT_OK for c in codes):
        return EXIT_OK
    return EXIT_FAILURE


def _descendants(pid: int) -> set[psutil.Process]:
    """psutil handles (not bare pids: a handle refuses to signal a reused pid)."""
    import psutil

    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _kill(processes: set[psutil.Process]) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _kill_all(proc: subprocess.Popen[bytes], known: set[psutil.Process]) -> None:
    """SIGKILL torchrun's group and every worker (each in a session of its own)."""
    _kill(known | _descendants(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class Ranks:
    """torchrun and this node's ranks, from `start_ranks` to `wait`'s public exit code.

    Started before the job file exists (`released=False`), the ranks import torch, DeepSpeed
    and diffusers while the entrypoint plans, then wait for the file (`job.wait_for_job`).
    Until `release()` a signal raises `StoppedBeforeStart` in the entrypoint, whose caller
    `cancel()`s the waiting ranks. After it, the first SIGTERM/SIGINT is forwarded to torchrun,
    which forwards it to every rank (give it `--shutdown-timeout` >= grace_seconds); a second
    signal, or ranks still running `grace_seconds` after the first, kills the whole tree.
    """

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        *,
        status_dir: Path,
        grace_seconds: float,
        expected_ranks: int | None = None,
        released: bool = True,
    ) -> None:
        self.status_dir = Path(status_dir)
        self.status_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.status_dir.glob("rank-*"):
            stale.unlink()  # an earlier run's statuses must not decide this run's exit code
        self.grace_seconds, self.expected_ranks = grace_seconds, expected_ranks
        self.released = released
        self.launcher = "torchrun" if "zerotuner.launch.torchrun" in argv else "the rank"
        self.signals = 0
        self.deadline: float | None = None  # when the first signal's grace runs out
        self.known: set[psutil.Process] = set()  # the workers seen so far
        self.signal_name = "signal"  # the first one's name
        self.proc: subprocess.Popen[bytes] | None = None
        pending = None

        def on_signal(signum: int, _frame: Any) -> None:
            nonlocal pending
            name = signal.Signals(signum).name
            if not self.released:
                raise StoppedBeforeStart(f"stopped by {name} before training: exit 143")
            self.signals += 1
            if self.signals == 1:
                self.signal_name = name
                log.warning("%s: asking the ranks to checkpoint and stop (%.0f s; again to kill "
                            "now)", name, grace_seconds)  # fmt: skip
                self.deadline = time.monotonic() + grace_seconds
            else:
                log.warning("second signal: killing every rank now")
            if self.proc is None:
                pending = signum  # acted on as soon as torchrun exists
            else:
                self._act(signum)

        # The handlers go in before torchrun starts: a signal in between must reach it, not
        # end this process and leave torchrun (in a session of its own) running.
        self._previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.proc = subprocess.Popen(argv, env=dict(env), start_new_session=True)
        except BaseException:
            self._restore()
            raise
        if pending is not None:
            self._act(pending)

    def _act(self, signum: int) -> None:
        """Forward the first signal to torchrun; the second kills the whole tree."""
        assert self.proc is not None
        self.known |= _descendants(self.proc.pid)
        if self.signals == 1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)
        else:
            _kill_all(self.proc, self.known)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def release(self) -> None:
        """The job file is written: the ranks go on, and signals reach them."""
        self.released = True

    def cancel(self) -> None:
        """The job will not run: kill the waiting ranks (nothing of theirs to save yet)."""
        assert self.proc is not None
        _kill_all(self.proc, self.known | _descendants(self.proc.pid))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._restore()

    def wait(self) -> int:
        """Run torchrun to the end and return the public exit code."""
        assert self.proc is not None
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    self.known |= _descendants(self.proc.pid)
                    if self.deadline is not None and time.monotonic() > self.deadline:
                        log.warning("ranks still running %.0f s after the signal: killing",
                                    self.grace_seconds)  # fmt: skip
                        _kill_all(self.proc, self.known)
                        self.deadline = None
            # Workers live in sessions of their own: none may outlive torchrun.
            _kill({p for p in self.known if p.is_running()})
        finally:
            self._restore()
        return self._exit_code(code)

    def failure_line(self) -> str:
        """The one line of the first rank that failed with one ("" when none said why): a
        rank killed by a signal first, the cause of its peers' broken connections."""
        failed = [s for s in read_rank_statuses(self.status_dir) if s.exit_code and s.message]
        return min(failed, key=lambda s: (not s.killed, s.rank)).message if failed else ""

    def _exit_code(self, code: int) -> int:
        statuses = read_rank_statuses(self.status_dir)
        expected = self.expected_ranks
        if expected is not None and len(statuses) < expected and code == 0:
            log.warning("%d of %d ranks reported a status", len(statuses), expected)
        result = exit_code(code, statuses, signalled=self.signals > 0)
        # Ranks that neither reported nor armed their SIGTERM handler were ended by the signal
        # itself (its default action) while they started: no step ran, so it is a stop.
        heard = {s.rank for s in statuses} | read_armed_ranks(self.status_dir)
        unarmed = (expected or 0) - len(heard)
        if self.signals and unarmed > 0 and result not in (EXIT_CONFIG, EXIT_ENVIRONMENT):
            log.warning("%s came before %d of %d rank(s) could handle it: stopped before "
                        "training, nothing to resume from: exit %d", self.signal_name, unarmed,
                        expected, EXIT_SIGNAL)  # fmt: skip
            result = EXIT_SIGNAL
        elif expected is not None and result == EXIT_SIGNAL and len(statuses) < expected:
            result = EXIT_FAILURE  # a rank died without confirming its checkpoint
        log.info("%s exited %s; ranks reported %s -> exit %d", self.launcher, code,
                 {s.rank: s.exit_code for s in statuses}, result)  # fmt: skip
        return result


def start_ranks(
    topology: Topology,
    hardware: Hardware,
    *,
    job_file: Path | str,
    status_dir: Path,
    grace_seconds: float,
    environ: Mapping[str, str] | None = None,
    module: str = "zerotuner.train.worker",
    released: bool = False,
) -> Ranks:
    """Start this node's ranks; with `released=False` they wait for `job_file` to appear.

    `status_dir` must be local to the node (e.g. under /tmp): it holds this node's ranks only.
    torchrun gets `grace_seconds` to let ranks save after SIGTERM; we wait a little longer so
    torchrun's own teardown runs first.
    """
    if topology.master_port == 0:
        # torchrun's static rendezvous cannot use port 0 itself: take a free one now.
        topology = dataclasses.replace(topology, master_port=free_port(topology.master_addr))
    env = worker_env(
        os.environ if environ is None else environ,
        topology,
        hardware,
        job_file=job_file,
        status_dir=status_dir,
    )
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if topology.world_size == 1:
        argv, lone = lone_rank(module, topology.master_addr, topology.master_port)
        env |= lone
    else:
        argv = torchrun_command(topology, module=module, shutdown_timeout=int(grace_seconds))
    return Ranks(
        argv,
        env,
        status_dir=status_dir,
        grace_seconds=grace_seconds + 5,
        expected_ranks=topology.nproc_per_node,
        released=released,
    )


def lone_rank(module: str, master_addr: str, master_port: int) -> tuple[list[str], dict[str, str]]:
    """The command and variables of a world of one rank. torchrun's agent would be one more
    interpreter importing torch (about 1 s before the rank starts) to supervise a single
    process: the rank runs as the launcher's child with the variables torchrun gives a rank,
    and signals reach it directly."""
    argv = [sys.executable, "-m", module]
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(master_port)}  # fmt: skip
    return argv, env


def launch(topology: Topology, hardware: Hardware, **kwargs: Any) -> int:
    """Run this node's ranks, their job file already written, to the end: the exit code."""
    return start_ranks(topology, hardware, released=True, **kwargs).wait()
