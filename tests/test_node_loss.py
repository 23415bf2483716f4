"""Losing a node: one line naming it, exit 200 (retryable), a restart that resumes, no orphan.

The real thing on 127.0.0.1: two entrypoints train together as node 0 and node 1; node 1 is
killed whole (SIGKILL to its entrypoint, torchrun and rank) at a random step; node 0 exits 200
within seconds with one line naming node 1, and both nodes started again resume at the last
checkpoint. An agent (torchrun) killed alone takes its rank with it. The watch itself
(heartbeats in a TCP store) and the exit-code mapping are checked in process.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from trainkit import ENTRYPOINT, entrypoint_env, steps_done

from bench.receiver import Receiver
from zerotuner.errors import (
    EXIT_FAILURE,
    EXIT_PEER_LOST,
    EXIT_SIGNAL,
    PeerLost,
)
from zerotuner.launch import distributed, peers
from zerotuner.launch.ranks import Topology, exit_code, free_port, worker_env
from zerotuner.launch.records import RankStatus
from zerotuner.launch.torchrun import EXPLAINED
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.settings.schema import load_settings
from zerotuner.weights.checkpoint import last_committed

INTERVAL = 4  # ZT_CHECKPOINT_EVERY_STEPS of the two-node run
EXIT_BOUND = 30  # seconds from the kill to node 0's exit (measured: 5 to 6.3)
ORPHAN_BOUND = 5  # seconds from the agent's kill to its rank's end (measured: under 2)


# --- the public contract ------------------------------------------------------------------


def test_exit_200_is_retryable_everywhere():
    assert PeerLost("x").exit_code == EXIT_PEER_LOST == 200
    assert 128 + 64 < EXIT_PEER_LOST <= 255  # Kubeflow ExitCode: retried; no signal's code
    assert EXIT_PEER_LOST in EXPLAINED  # torchrun adds no traceback to the rank's own line


@pytest.mark.parametrize(
    ("ranks", "signalled", "expected"),
    [
        ([200], False, 200),
        ([200, 200], False, 200),
        ([200, 1], False, 1),  # a rank of this node failed on its own: this node's failure
        ([200, 2], False, 2),
        ([200, 143], True, 200),  # a stop and a loss at once: the retry resumes either way
        ([143, 143], True, 143),
    ],
)
def test_a_lost_node_maps_to_exit_200(ranks, signalled, expected):
    statuses = [RankStatus(i, c) for i, c in enumerate(ranks)]
    assert exit_code(1, statuses, signalled=signalled) == expected


# --- the NCCL and timeout decisions ---------------------------------------------------------


def test_nccl_fails_a_collective_instead_of_hanging(tmp_path):
    gpus = Hardware("cuda", (GPU(0, "H100", 80 * GiB, 80 * GiB),), cpu_count=8)
    env = worker_env({}, Topology(2, 0, 1, "h", 1, "x"), gpus, job_file="j", status_dir="s")
    # the watchdog aborts the communicator and ends the process when a collective fails or
    # outlasts the group's timeout; wait() stays non-blocking (no per-collective CPU sync)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in env
    own = worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, Topology(2, 0, 1, "h", 1, "x"),
                     gpus, job_file="j", status_dir="s")  # fmt: skip
    assert own["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's choice stands


def test_the_group_gets_the_collective_timeout(monkeypatch):
    import deepspeed

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    # each rank on its own GPU before NCCL binds its communicator (no GPU here: recorded)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.update(device=index))
    world = distributed.init_distributed(
        device="cuda", master_addr="h", master_port=1, timeout_seconds=90
    )
    assert seen == {"device": 1, "dist_backend": "nccl", "timeout": timedelta(seconds=90)}
    assert world == distributed.World(rank=0, local_rank=1, size=2, device="cuda:1")


def test_timeouts_in_the_order_that_names_a_lost_node(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    defaults = load_settings()
    # peer (60) < collective (600) < hang (1800): the default order is quiet
    assert (defaults.peer_timeout_seconds, defaults.collective_timeout_seconds,
            defaults.hang_timeout_seconds) == (60, 600, 1800)  # fmt: skip
    assert distributed.timeout_warnings(defaults, device="cuda") == []
    late = load_settings(collective_timeout_seconds=3600)
    (warning,) = distributed.timeout_warnings(late, device="cuda")
    assert "ZT_COLLECTIVE_TIMEOUT_SECONDS=3600" in warning and "liveness probe" in warning
    slow_peer = load_settings(peer_timeout_seconds=900)
    assert "ZT_PEER_TIMEOUT_SECONDS=900" in distributed.timeout_warnings(slow_peer, device="cpu")[0]
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    assert "wait forever" in distributed.timeout_warnings(defaults, device="cuda")[0]
    assert distributed.timeout_warnings(defaults, device="cpu") == []


# --- the watch, in process on a real TCP store -----------------------------------------------


@contextmanager
def watching(world: int, local: int, *, on_lost_for=None, **kw):
    """`world` started PeerWatches on a real TCP store, node = rank // local, settled at the
    end. Yields ([the store's server], watches): clear the list to take the store down (node
    0's agent gone). `on_lost_for(rank)` gives each rank its own `on_lost`."""
    server = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    watches: list[peers.PeerWatch] = []
    try:
        for r in range(world):
            own = {"on_lost": on_lost_for(r)} if on_lost_for else {}
            watches.append(peers.PeerWatch(
                peers.connect_store("127.0.0.1", server[0].port, timeout_seconds=5), rank=r,
                world=world, local_world=local, master_addr="127.0.0.1", host=f"host{r // local}",
                beat_seconds=0.1, watch_seconds=0.1, **own, **kw,
            ).start())  # fmt: skip
        yield server, watches
    finally:
        for watch in watches:
            watch.settle()
        server.clear()


def test_a_silent_node_is_named_and_every_node_agrees():
    with watching(4, 2) as (_, watches):
        assert watches[0].diagnose(seconds=1) is None  # every rank counts: no node lost
        for lost in watches[2:]:
            lost.settle()  # node 1 (ranks 2 and 3) stops counting
        verdict = watches[0].diagnose(seconds=1)
        assert verdict == peers.LostPeers(1, "host1", (2, 3), "stopped answering")
        assert verdict.describe() == "node 1 (host host1, ranks 2-3)"
        assert watches[1].diagnose(seconds=1) == verdict  # the recorded verdict, at once


def test_a_rank_of_this_node_gone_is_no_lost_peer():
    with watching(4, 2) as (_, watches):
        watches[1].settle()  # this node's own rank: a local failure, not another node's
        assert watches[0].diagnose(seconds=1) is None


def test_the_store_gone_means_node_0_lost():
    with watching(2, 1) as (server, watches):
        watches[0].settle()
        server.clear()  # node 0's agent, which holds the store, is gone
        time.sleep(0.3)
        verdict = watches[1].diagnose(seconds=1)
        assert verdict is not None and verdict.node == 0 and verdict.host == "127.0.0.1"
        assert watches[0].diagnose(seconds=1) is None  # node 0 never blames itself


def test_the_watch_ends_every_rank_when_a_node_goes_silent():
    """No failed collective needed (NCCL may wait in one for its whole timeout): after
    `silent_seconds` a node's first rank records the verdict; each rank's heartbeat acts on it."""
    import threading

    found: dict[int, peers.LostPeers] = {}
    done = threading.Event()

    def on_lost(rank):
        def report(verdict):
            found[rank] = verdict
            if len(found) == 2:
                done.set()

        return report

    with watching(3, 1, on_lost_for=on_lost, silent_seconds=0.5) as (_, watches):
        watches[2]._stop.set()  # node 2 freezes: no error, no beat
        assert done.wait(10), found
        assert (
            found[0] == found[1]
            and found[0].node == 2
            and "no sign of life for 0.5 s" in found[0].how
        )


# --- a rank dies with its agent --------------------------------------------------------------

FAKE_RANK = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from zerotuner.launch.peers import die_with_parent

    assert die_with_parent()
    Path(os.environ["TEST_OUT"], f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)
    """
)


def test_a_rank_dies_with_its_agent(tmp_path):
    """SIGKILL to torchrun alone (a bare host, a Slurm step, an OOM kill): its rank goes too."""
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    env = dict(os.environ, TEST_OUT=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *sys.path]))  # fmt: skip
    env.pop("ZT_LAUNCHER_PID", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "zerotuner.launch.torchrun", "--nnodes=1", "--nproc-per-node=1",
         f"--master-port={free_port()}", "--max-restarts=0", "-m", "fake_rank"],
        env=env, start_new_session=True,
    )  # fmt: skip
    try:
        ready = tmp_path / "rank-0"
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert agent.poll() is None and time.monotonic() < deadline, "the rank never started"
            time.sleep(0.1)
        rank = psutil.Process(int(ready.read_text()))
        assert rank.ppid() == agent.pid
        agent.kill()
        killed = time.monotonic()
        agent.wait(timeout=10)
        gone, alive = psutil.wait_procs([rank], timeout=ORPHAN_BOUND)
        assert not alive, f"the rank outlived its agent by {ORPHAN_BOUND} s"
        print(f"rank gone {time.monotonic() - killed:.2f} s after its agent")
    finally:
        if agent.poll() is None:
            agent.kill()


def test_the_worker_never_outlives_an_agent_killed_while_it_starts(tmp_path):
    """The real rank, its agent SIGKILLed while the rank still imports (before it could ask
    for the signal): it sees its agent gone when it asks, and ends there."""
    env = dict(os.environ, ZT_JOB_FILE=str(tmp_path / "never.json"))
    env |= {"ZT_STATUS_DIR": str(tmp_path / "status"), "ZT_OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("ZT_LAUNCHER_PID", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "zerotuner.launch.torchrun", "--nnodes=1", "--nproc-per-node=1",
         f"--master-port={free_port()}", "--max-restarts=0", "-m", "zerotuner.train.worker"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (children := psutil.Process(agent.pid).children()):
            assert agent.poll() is None and time.monotonic() < deadline, "no rank started"
            time.sleep(0.05)
        (rank,) = children
        agent.kill()
        agent.wait(timeout=10)
        _, alive = psutil.wait_procs([rank], timeout=120)  # the rest of its imports, at most
        assert not alive, "the rank outlived its agent"
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_rank_whose_agent_died_before_it_asked_exits_at_once(tmp_path):
    code = "from zerotuner.launch.peers import die_with_parent; die_with_parent(); print('alive')"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the agent: it died before its rank asked
    env = dict(os.environ, ZT_AGENT_PID=str(gone.pid))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 128 + signal.SIGKILL and "alive" not in done.stdout
    # a pid inherited from elsewhere, alive but not the parent: no death, the rank goes on
    env = dict(os.environ, ZT_AGENT_PID="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and "alive" in done.stdout


def test_the_worker_asks_to_die_with_its_agent_first(monkeypatch):
    from zerotuner.train import worker

    class Asked(Exception):
        pass

    def asked():
        raise Asked

    monkeypatch.setattr(peers, "die_with_parent", asked)
    monkeypatch.setattr(worker, "effective_settings", lambda **kw: pytest.fail("too late"))
    with pytest.raises(Asked):
        worker.main()


# --- two nodes on 127.0.0.1, node 1 killed whole -----------------------------------------------


def _start_nodes(demo_dir: Path, out: Path, port: int, logs: Path, **extra: str):
    common = {
        "ZT_NNODES": "2", "ZT_NUM_PROCESSES": "1", "ZT_MASTER_ADDR": "127.0.0.1",
        "ZT_MASTER_PORT": str(port), "ZT_MAX_STEPS": "60", "ZT_RESUME": "auto",
        "ZT_CHECKPOINT_EVERY_STEPS": str(INTERVAL), "ZT_CHECKPOINTS_KEEP": "2",
        "ZT_TRAIN_BATCH_SIZE": "1", **extra,
    }  # fmt: skip
    nodes = []
    for rank in (0, 1):
        log = (logs / f"node{rank}.log").open("w")
        nodes.append(
            subprocess.Popen(
                [ENTRYPOINT, "train"],
                env=entrypoint_env(demo_dir, out, ZT_NODE_RANK=str(rank), **common),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        )
    return nodes


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a node whole: its entrypoint, torchrun and rank, at once (as a lost machine)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@pytest.mark.slow
def test_node_1_killed_whole_node_0_says_so_and_a_restart_resumes(demo_dir, tmp_path):
    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randint(INTERVAL + 2, 3 * INTERVAL)
    why = f"(seed {seed}, kill at step {kill_at})"
    with Receiver() as webhook:  # ZT_NOTIFY_URL (issue 46): node 0 tells the loss, with its line
        nodes = _start_nodes(demo_dir, tmp_path, free_port(), tmp_path,
                             ZT_NOTIFY_URL=webhook.url)  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while len(steps_done(tmp_path)) < kill_at:
                assert all(n.poll() is None for n in nodes), (tmp_path / "node0.log").read_text()
                assert time.monotonic() < deadline, why
                time.sleep(0.05)
            _kill_tree(nodes[1])
            killed = time.monotonic()
            code = nodes[0].wait(timeout=EXIT_BOUND + 60)
            took = time.monotonic() - killed
        finally:
            for node in nodes:
                _kill_tree(node)
    starts = [b for b in webhook.bodies if b["title"] == "zerotuner: start"]
    assert len(starts) == 1, webhook.bodies  # node 0's entrypoint alone tells
    told = webhook.bodies[-1]
    assert told["type"] == "failure" and told["message"].startswith("exit 200: "), told
    log = (tmp_path / "node0.log").read_text()
    assert code == EXIT_PEER_LOST, f"{why} exit {code}\n{log[-4000:]}"
    assert took < EXIT_BOUND, f"{why} node 0 took {took:.1f} s"
    print(f"{why}: node 0 exited {EXIT_PEER_LOST} {took:.1f} s after node 1 was killed")
    lines = [line for line in log.splitlines() if line.startswith("zerotuner: error: lost ")]
    assert len(lines) == 1, log[-4000:]
    (line,) = lines
    last = steps_done(tmp_path)[-1]["step"]
    checkpoint = last_committed(tmp_path / "output")
    assert checkpoint is not None, why
    saved = int(checkpoint.name.removeprefix("step-"))
    assert last - saved <= INTERVAL, why  # at most one interval lost
    assert f"lost node 1 (host {socket.gethostname()}, rank 1) after step {last}:" in line, line
    assert f"resumes from {checkpoint}" in line and "exit 200" in line, line
    assert line.removeprefix("zerotuner: error: ") in told["message"], told
    # no traceback (the rank's gloo error, torchrun's ChildFailedError), no line of success
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-4000:]
    assert not re.search(r"zerotuner.progress: \d+ steps in", log), log[-4000:]
    assert "stopped unfinished after" in log
    assert "failed (exitcode: 200)" not in log  # torchrun's own line about it: dropped

    # both nodes again: they resume at that checkpoint and finish
    nodes = _start_nodes(demo_dir, tmp_path, free_port(), tmp_path, ZT_MAX_STEPS=str(last + 2))
    try:
        codes = [node.wait(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            _kill_tree(node)
    log = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], log[-4000:]
    assert f"at step {saved}" in log, log[-4000:]  # "resumed from ... at step N"
    steps = [s["step"] for s in steps_done(tmp_path)]
    assert steps == list(range(1, last + 3)), why


def test_lost_line_without_a_checkpoint(tmp_path):
    from zerotuner.train.lost_peer import Whereabouts, lost_line

    where = Whereabouts()
    where.on_phase("caching")
    settings = load_settings(output_dir=tmp_path)
    line = lost_line(peers.LostPeers(2, "gpu-7", (16, 17)), where, settings)
    assert line == (
        "lost node 2 (host gpu-7, ranks 16-17) while caching (no step yet): it stopped "
        "answering. Restart every node (exit 200, retryable); training starts over: no "
        "checkpoint was committed yet"
    )
    assert EXIT_FAILURE != EXIT_PEER_LOST != EXIT_SIGNAL
