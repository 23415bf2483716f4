"""The ranks' process group: joining it, the collectives the worker's phases share, leaving it.

A lone process (no torchrun) is rank 0 of 1 and every collective here is then a no-op.

Collectives fail after ZT_COLLECTIVE_TIMEOUT_SECONDS. A phase whose length grows with the
data (caching: one rank per node encodes while the others wait) waits in `PatientBarrier`
instead: no deadline while every rank is alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from zerotuner.errors import ZeroTunerError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # how often a waiting rank asks the store whether all have arrived
BEAT_SECONDS = 5.0  # how often each rank in a PatientBarrier says it is alive
SILENT_SECONDS = 60.0  # a rank silent this long is gone


@dataclass(frozen=True)
class World:
    """This rank's place in the job, read once from torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE; one rank started directly has none) and handed to whoever needs it."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: str = "cpu"  # "cpu", or "cuda:<local rank>": the GPU this rank trains on

    @classmethod
    def from_environ(cls, device: str = "cpu") -> World:
        """`device`: the job's ("cpu" or "cuda")."""
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return cls(
            rank=int(os.environ.get("RANK", "0")), local_rank=local,
            size=int(os.environ.get("WORLD_SIZE", "1")),
            device="cpu" if device == "cpu" else f"cuda:{local}",
        )  # fmt: skip

    @property
    def node_leader(self) -> bool:
        """The node's first rank: the one that downloads, writes indexes and prints once."""
        return self.local_rank == 0


def init_distributed(
    *, device: str, master_addr: str, master_port: int, timeout_seconds: float = 600
) -> World:
    """Join the process group torchrun described (gloo on CPU); returns this rank's World.
    `timeout_seconds`: how long a collective may wait for the other ranks."""
    import deepspeed

    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, default)
    world = World.from_environ(device)
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if device == "cuda":
        # Each rank on its own GPU before anything touches CUDA: NCCL binds a communicator to
        # the current device, and collectives before deepspeed.initialize (caching) use it.
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        # On the CPU every rank prints "DeepSpeed ...shm_comm_op built successfully": a debug
        # line, unless joining fails and what was printed may say why.
        printed = io.StringIO()
        failed = True
        try:
            with contextlib.redirect_stdout(printed):
                deepspeed.init_distributed(
                    dist_backend="gloo" if device == "cpu" else "nccl",
                    timeout=timedelta(seconds=timeout_seconds),
                )
            failed = False
        finally:
            if text := printed.getvalue().strip():
                log.log(logging.WARNING if failed else logging.DEBUG, "%s", text)
    return dataclasses.replace(world, rank=dist.get_rank(), size=dist.get_world_size())


def timeout_warnings(settings: Any, *, device: str) -> list[str]:
    """What the failure timeouts, as set, would do wrong (rank 0 logs them; none by default).

    The order that makes a lost node a retry, not a stuck job: a silent node is lost after
    ZT_PEER_TIMEOUT_SECONDS (60), a stuck collective fails after ZT_COLLECTIVE_TIMEOUT_SECONDS
    (600; on NCCL the watchdog aborts the process, TORCH_NCCL_ASYNC_ERROR_HANDLING=1), and only
    then does /healthz turn 503 (ZT_HANG_TIMEOUT_SECONDS, 1800) for the liveness probe."""
    collective = settings.collective_timeout_seconds
    hang = settings.hang_timeout_seconds
    peer = settings.peer_timeout_seconds
    warnings = []
    if collective >= hang:
        warnings.append(
            f"ZT_COLLECTIVE_TIMEOUT_SECONDS={collective:g} is not below "
            f"ZT_HANG_TIMEOUT_SECONDS={hang:g}: a rank stuck in a collective is restarted by the "
            "liveness probe before it fails with a line of its own"
        )
    if peer >= min(collective, hang):
        warnings.append(
            f"ZT_PEER_TIMEOUT_SECONDS={peer:g} is not below ZT_COLLECTIVE_TIMEOUT_SECONDS="
            f"{collective:g} and ZT_HANG_TIMEOUT_SECONDS={hang:g}: a silent node is found by "
            "a timeout that cannot name it"
        )
    if device == "cuda" and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") in ("0", "2"):
        warnings.append(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING="
            f"{os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING']}: a rank whose collective timed out "
            "is not ended and may wait forever; leave it unset (zerotuner sets 1)"
        )
    return warnings


def node_leader(rank: int, world: int) -> tuple[int, int] | None:
    """(this node's index, the number of nodes) on each node's first local rank, else None.
    torchrun numbers the ranks of a node contiguously, LOCAL_WORLD_SIZE per node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    return rank // local, max(1, world // local)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class PatientBarrier:
    """Barriers with no deadline, for phases as long as the data (use as a context manager).

    `wait()` counts this rank in at a key of torchrun's TCP store and polls it until every rank
    is in: no collective runs, so the process group's timeout does not apply. No endless wait
    either: each rank counts a heartbeat key up every BEAT_SECONDS (a thread), and a waiting
    rank fails when a rank it watches stays still for `silent_seconds`. Each rank watches its
    own node's ranks: when one dies, torchrun sends the others SIGTERM, which the worker only
    notes until caching ends, and SIGKILL only after ZT_STOP_GRACE_SECONDS. Rank 0 watches
    every rank: its failure stops node 0, whose torchrun hosts the store, so every other
    rank's poll fails too.
    """

    _names = itertools.count()  # each barrier of a run gets its own keys

    def __init__(
        self,
        name: str,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world: int | None = None,
        silent_seconds: float = SILENT_SECONDS,
    ) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self.store = store or (dist.distributed_c10d._get_default_store() if grouped else None)
        self.rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
        self.world = world if world is not None else (dist.get_world_size() if grouped else 1)
        self.prefix = f"zerotuner/{name}/{next(self._names)}"
        self.silent_seconds = silent_seconds
        self._rounds = 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        node = self.rank // local * local
        self.watched = range(self.world) if self.rank == 0 else range(node, node + local)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beat_loop, daemon=True)

    def __enter__(self) -> PatientBarrier:
        if self.store is not None:
            self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(timeout=BEAT_SECONDS)

    def _beat_loop(self) -> None:
        assert self.store is not None  # __enter__ starts the beat only with a store
        key = f"{self.prefix}/beat/{self.rank}"
        while True:
            with contextlib.suppress(Exception):  # a store gone: the wait says so
                self.store.add(key, 1)
            if self._stop.wait(BEAT_SECONDS):
                return

    def wait(self) -> None:
        """Return once every rank has called wait() as many times as this one."""
        store = self.store
        if store is None or self.world == 1:
            return
        self._rounds += 1
        key = f"{self.prefix}/round/{self._rounds}"
        beats: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last changed)
        checked = 0.0
        try:
            store.add(key, 1)
            while store.add(key, 0) < self.world:
                time.sleep(POLL_SECONDS)
                if time.monotonic() - checked > BEAT_SECONDS:
                    self._check_alive(store, beats)  # one read per rank, once a beat
                    checked = time.monotonic()
        except ZeroTunerError:
            raise
        except Exception as error:  # noqa: BLE001 - the store's host (node 0) is gone
            raise ZeroTunerError(
                f"lost torchrun's store while waiting for the other ranks ({error}); "
                "another node stopped"
            ) from None

    def _check_alive(self, store: dist.Store, beats: dict[int, tuple[int, float]]) -> None:
        now = time.monotonic()
        for rank in self.watched:
            count = store.add(f"{self.prefix}/beat/{rank}", 0)
            last = beats.get(rank)
            if last is None or last[0] != count:
                beats[rank] = (count, now)
            elif now - last[1] > self.silent_seconds:
                raise ZeroTunerError(
                    f"rank {rank} gave no sign of life for {self.silent_seconds:.0f} s while "
                    "the others waited for it (its node stopped?); stopping the job"
                )


def collective_device() -> torch.device:
    """Where a tensor for the world group's collectives must live: NCCL reduces GPU tensors
    only ("No backend type associated with device type cpu", seen on an H200), gloo CPU ones."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[int]) -> list[int]:
    """Each value summed over the ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.long, device=collective_device())
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def leave_group() -> None:
    """Destroy the process group before exit: a gloo group left to the interpreter's
    teardown can abort the process (SIGABRT) when a peer has already gone."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a finished rank with `code`, skipping the interpreter's teardown: even with the
    group left, C++ destructors there once aborted a done rank (SIGABRT), failing a done run."""
    leave_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
