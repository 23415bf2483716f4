"""Who is still there: a rank's own agent, and the other nodes of a multi-node job.

- **The agent.** A rank asks the kernel to SIGKILL it when its parent (torchrun's agent, or the
  entrypoint for a lone rank) dies (`die_with_parent`, Linux `PR_SET_PDEATHSIG`): an agent
  killed on a bare host, in a Slurm step or by the OOM killer leaves no orphan training on
  with the other nodes, outside any supervision. The last committed checkpoint is untouched.
- **The other nodes.** Every rank counts a key of torchrun's store up once a second
  (`PeerWatch`). When a collective fails (gloo: "Connection closed by peer"), the rank asks
  which ranks stopped counting (`PeerWatch.diagnose`): ranks of another node gone quiet, or the
  store itself gone (it lives in node 0's agent), make the failure a lost node: exit 200
  (`errors.PeerLost`) with one line naming it, the step and the checkpoint a restart resumes
  from. A lost node that leaves no error behind (a peer that vanished from the network, NCCL
  waiting in a collective) is found by the watch itself: each node's first rank watches the
  other nodes' counts and, after `silent_seconds` of silence, records the verdict in the store,
  where every rank's heartbeat finds it and ends its process the same way (`on_lost`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from zerotuner.launch.job import LAUNCHER_PID_ENV

log = logging.getLogger(__name__)

AGENT_PID_ENV = "ZT_AGENT_PID"  # set by zerotuner.launch.torchrun: the ranks' parent
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

PREFIX = "zerotuner/peers"
VERDICT_KEY = f"{PREFIX}/lost"
BEAT_SECONDS = 1.0  # each rank counts its key up this often
WATCH_SECONDS = 2.0  # how often a node's first rank reads the other nodes' counts
DIAGNOSE_SECONDS = 3.0  # after a failed collective: a live rank counts up within this


def die_with_parent(sig: int = signal.SIGKILL, *, environ: Mapping[str, str] | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies; exit at once if the
    parent died already (before this call). False where the platform has no such signal."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The parent may have died between this process's start and prctl: then it was handed
    # to init (or a subreaper) and no signal will ever come. (A pid that is not the parent
    # but alive is an inherited variable, not a death.)
    expected = environ.get(AGENT_PID_ENV) or environ.get(LAUNCHER_PID_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        try:
            os.kill(int(expected), 0)
        except ProcessLookupError:
            os._exit(128 + int(sig))
        except PermissionError:
            pass  # alive, someone else's
    return True


@dataclass(frozen=True)
class LostPeers:
    """Ranks of one other node that stopped answering."""

    node: int
    host: str
    ranks: tuple[int, ...]
    how: str = "stopped answering"

    def describe(self) -> str:
        ranks = self.ranks
        if not ranks:
            which = ""
        elif len(ranks) == 1:
            which = f", rank {ranks[0]}"
        elif list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
            which = f", ranks {ranks[0]}-{ranks[-1]}"
        else:
            which = ", ranks " + ",".join(map(str, ranks))
        return f"node {self.node} (host {self.host}{which})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> LostPeers:
        data = json.loads(text)
        data["ranks"] = tuple(data.get("ranks", ()))
        return cls(**data)


def _beat_key(rank: int) -> str:
    return f"{PREFIX}/beat/{rank}"


def _host_key(rank: int) -> str:
    return f"{PREFIX}/host/{rank}"


class PeerWatch:
    """Heartbeats of every rank in torchrun's store, and the verdict when a node is lost.

    `store`: a client of torchrun's store (`connect_store`); `on_lost(verdict)` runs on the
    heartbeat thread when another rank recorded a lost node, or when this node's first rank
    found one silent for `silent_seconds` (the worker ends its process there: its main thread
    may be stuck in a collective). `settle()` ends the watch for good: once the rank knows its
    outcome, no verdict may replace it.
    """

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world: int,
        local_world: int,
        master_addr: str,
        silent_seconds: float = 60.0,
        on_lost: Callable[[LostPeers], None] | None = None,
        host: str | None = None,
        beat_seconds: float = BEAT_SECONDS,
        watch_seconds: float = WATCH_SECONDS,
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.local_world = max(1, local_world)
        self.node = rank // self.local_world
        self.master_addr = master_addr
        self.silent_seconds = silent_seconds
        self.on_lost = on_lost
        self.host = host or socket.gethostname()
        self.beat_seconds, self.watch_seconds = beat_seconds, watch_seconds
        self.others = [r for r in range(world) if r // self.local_world != self.node]
        self.leader = rank % self.local_world == 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._claimed = False
        self._thread = threading.Thread(target=self._loop, name="zerotuner-peers", daemon=True)

    # --- life -------------------------------------------------------------------------------
    def start(self) -> PeerWatch:
        self.store.set(_host_key(self.rank), self.host)
        self.store.add(_beat_key(self.rank), 1)
        self._thread.start()
        return self

    def settle(self) -> None:
        """This rank knows its outcome: stop beating and watching; no verdict acts after."""
        with self._lock:
            self._claimed = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.beat_seconds)

    def claim(self) -> bool:
        """True once: the caller reports the loss and ends the rank."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    # --- the heartbeat thread ---------------------------------------------------------------
    def _loop(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last changed)
        watched = 0.0
        while not self._stop.wait(self.beat_seconds):
            verdict = None
            try:
                self.store.add(_beat_key(self.rank), 1)
                if self.store.check([VERDICT_KEY]):
                    verdict = LostPeers.from_json(self.store.get(VERDICT_KEY))
                elif self.leader and time.monotonic() - watched >= self.watch_seconds:
                    watched = time.monotonic()
                    verdict = self._silent(seen)
            except Exception as error:  # noqa: BLE001 - the store (node 0's agent) is gone
                if self._stop.is_set():
                    return
                verdict = self._store_lost(error)
            if verdict is not None and verdict.node != self.node:
                if self.on_lost is not None and self.claim():
                    self.on_lost(verdict)
                return

    def _silent(self, seen: dict[int, tuple[int, float]]) -> LostPeers | None:
        """The first other node with a rank silent for `silent_seconds` (recorded as the
        job's verdict), else None."""
        if not self.others or not self.store.check([_beat_key(r) for r in self.others]):
            return None  # not every rank registered yet
        counts = self.store.multi_get([_beat_key(r) for r in self.others])
        now = time.monotonic()
        silent = []
        for rank, raw in zip(self.others, counts, strict=True):
            count = int(raw)
            last = seen.get(rank)
            if last is None or last[0] != count:
                seen[rank] = (count, now)
            elif now - last[1] > self.silent_seconds:
                silent.append(rank)
        if not silent:
            return None
        how = f"gave no sign of life for {self.silent_seconds:g} s"
        return self._record(self._lost_node(silent, how))

    # --- after a failed collective ----------------------------------------------------------
    def diagnose(self, seconds: float = DIAGNOSE_SECONDS) -> LostPeers | None:
        """Which other node is gone, if one is: the verdict another rank recorded, else the
        ranks whose count did not move for `seconds`, else the store's own host (node 0) when
        the store is unreachable. None when every rank still counts, or when a rank of this
        node went quiet too (then the failure is this node's own)."""
        try:
            if self.store.check([VERDICT_KEY]):
                verdict = LostPeers.from_json(self.store.get(VERDICT_KEY))
                return None if verdict.node == self.node else verdict  # this node was "lost"
            keys = [_beat_key(r) for r in range(self.world)]
            first = [int(v) for v in self.store.multi_get(keys)]
            quiet = set(range(self.world)) - {self.rank}
            deadline = time.monotonic() + seconds
            while quiet and time.monotonic() < deadline:
                time.sleep(min(self.beat_seconds / 2, 0.5))
                now = [int(v) for v in self.store.multi_get(keys)]
                quiet = {r for r in quiet if now[r] == first[r]}
        except Exception as error:  # noqa: BLE001 - the store (node 0's agent) is gone
            return self._store_lost(error)
        if not quiet or any(r // self.local_world == self.node for r in quiet):
            return None
        return self._record(self._lost_node(sorted(quiet), "stopped answering"))

    # --- verdicts -----------------------------------------------------------------------------
    def _lost_node(self, ranks: list[int], how: str) -> LostPeers:
        node = ranks[0] // self.local_world
        on_node = tuple(r for r in ranks if r // self.local_world == node)
        try:
            host = self.store.get(_host_key(on_node[0])).decode()
        except Exception:  # noqa: BLE001 - a name for the line only
            host = "unknown"
        return LostPeers(node, host, on_node, how)

    def _record(self, verdict: LostPeers) -> LostPeers:
        """The job's one verdict: the first recorded wins, so every node names the same."""
        try:
            return LostPeers.from_json(self.store.compare_set(VERDICT_KEY, "", verdict.to_json()))
        except Exception:  # noqa: BLE001 - the store went too: our own verdict stands
            return verdict

    def _store_lost(self, error: Exception) -> LostPeers | None:
        if self.node == 0:
            return None  # the store lives in this node's agent: not another node's loss
        log.debug("torchrun's store is unreachable: %s", error)
        ranks = tuple(range(self.local_world))
        return LostPeers(0, self.master_addr, ranks, "stopped answering (its store is gone)")


def connect_store(master_addr: str, master_port: int, *, timeout_seconds: float) -> Any:
    """A client of torchrun's store (in node 0's agent) of its own, whose operations fail
    after `timeout_seconds` (the process group's client waits as long as a collective)."""
    import torch.distributed as dist

    return dist.TCPStore(
        master_addr,
        int(master_port),
        is_master=False,
        timeout=timedelta(seconds=timeout_seconds),
        wait_for_workers=False,
    )


def start_watch(
    *,
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    silent_seconds: float,
    on_lost: Callable[[LostPeers], None] | None,
    environ: Mapping[str, str] | None = None,
) -> PeerWatch | None:
    """The watch of a multi-node job's rank (None for a job on one node, or without a store
    to reach: there is no other node to lose)."""
    environ = os.environ if environ is None else environ
    local = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world <= local:
        return None
    addr = environ.get("MASTER_ADDR", master_addr)
    port = int(environ.get("MASTER_PORT", str(master_port)))
    try:
        store = connect_store(addr, port, timeout_seconds=silent_seconds)
        return PeerWatch(
            store, rank=rank, world=world, local_world=local, master_addr=addr,
            silent_seconds=silent_seconds, on_lost=on_lost,
        ).start()  # fmt: skip
    except Exception as error:  # noqa: BLE001 - no watch: failures read as they always did
        log.warning("no watch of the other nodes (torchrun's store at %s:%s: %s)", addr, port,
                    error)  # fmt: skip
        return None
