"""Topology, torchrun argv and worker env per platform; exit codes and signals with real ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from zerotuner.errors import ConfigError
from zerotuner.launch.ranks import (
    Topology,
    exit_code,
    launch,
    resolve_topology,
    torchrun_command,
    worker_env,
)
from zerotuner.launch.records import RankStatus
from zerotuner.machine.hardware import GPU, GiB, Hardware, cpu_only
from zerotuner.settings.schema import load_settings

FOUR_GPUS = Hardware(
    "cuda", tuple(GPU(i, "A100", 80 * GiB, 80 * GiB) for i in range(4)), cpu_count=32
)


@pytest.mark.parametrize(
    ("settings", "environ", "hardware", "expected"),
    [
        # plain `docker run --gpus all`: one node, one rank per visible GPU
        ({}, {}, FOUR_GPUS, Topology(1, 0, 4, "127.0.0.1", 0, "single node")),
        # CPU: one rank unless ZT_NUM_PROCESSES says otherwise
        ({}, {}, cpu_only(), Topology(1, 0, 1, "127.0.0.1", 0, "single node")),
        (
            {"num_processes": 2},
            {},
            cpu_only(),
            Topology(1, 0, 2, "127.0.0.1", 0, "single node"),
        ),
        # explicit ZT_* (docker on two hosts)
        (
            {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 12345},
            {},
            FOUR_GPUS,
            Topology(2, 1, 4, "10.0.0.5", 12345, "ZT_NNODES, ZT_NODE_RANK"),
        ),
        # Kubeflow PyTorchJob (v1): RANK/WORLD_SIZE count nodes and are ignored
        (
            {},
            {
                "PET_NNODES": "3",
                "PET_NODE_RANK": "2",
                "PET_MASTER_ADDR": "job-master-0",
                "PET_MASTER_PORT": "23456",
                "PET_NPROC_PER_NODE": "auto",
                "RANK": "2",
                "WORLD_SIZE": "3",
            },
            FOUR_GPUS,
            Topology(3, 2, 4, "job-master-0", 23456, "PET_*"),
        ),
        # Kubeflow TrainJob (v2): PET_NPROC_PER_NODE is a number
        (
            {},
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "0",
                "PET_MASTER_ADDR": "train-node-0-0.train",
                "PET_MASTER_PORT": "29400",
                "PET_NPROC_PER_NODE": "2",
            },
            FOUR_GPUS,
            Topology(2, 0, 2, "train-node-0-0.train", 29400, "PET_*"),
        ),
        # ZT_* wins over PET_*
        (
            {"nnodes": 4, "master_addr": "mine"},
            {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "theirs"},
            FOUR_GPUS,
            Topology(4, 1, 4, "mine", 29500, "ZT_NNODES"),
        ),
        # Indexed Job: JOB_COMPLETION_INDEX + ZT_MASTER_ADDR (+ ZT_NNODES = completions)
        (
            {"nnodes": 2, "master_addr": "zt-0.zt"},
            {"JOB_COMPLETION_INDEX": "1"},
            FOUR_GPUS,
            Topology(2, 1, 4, "zt-0.zt", 29500, "ZT_NNODES, JOB_COMPLETION_INDEX"),
        ),
    ],
    ids=["docker", "cpu", "cpu-2", "zt-env", "kubeflow-v1", "kubeflow-v2", "zt-wins", "indexed"],
)
def test_topology(settings, environ, hardware, expected):
    assert resolve_topology(load_settings(**settings), hardware, environ) == expected


@pytest.mark.parametrize(
    ("settings", "environ", "word"),
    [
        ({"nnodes": 2}, {}, "ZT_MASTER_ADDR"),
        ({}, {"JOB_COMPLETION_INDEX": "1"}, "ZT_NNODES"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "x"}, {}, "outside 0..1"),
        ({}, {"PET_NNODES": "1:4", "PET_MASTER_ADDR": "x"}, "elastic"),
        ({"num_processes": 8}, {}, "only 4 GPUs"),
    ],
)
def test_topology_errors_name_the_setting(settings, environ, word):
    with pytest.raises(ConfigError, match=word):
        resolve_topology(load_settings(**settings), FOUR_GPUS, environ)


def test_torchrun_command_is_static_and_complete():
    topo = Topology(2, 1, 4, "10.0.0.5", 12345, "x")
    argv = torchrun_command(topo, shutdown_timeout=120, python="/py")
    assert argv == [
        "/py", "-m", "zerotuner.launch.torchrun", "--nnodes=2", "--node-rank=1",
        "--nproc-per-node=4", "--master-addr=10.0.0.5", "--master-port=12345",
        "--rdzv-backend=static", "--max-restarts=0", "--shutdown-timeout=120",
        "-m", "zerotuner.train.worker",
    ]  # fmt: skip


def test_worker_env_gpu_and_cpu(tmp_path):
    topo = Topology(1, 0, 4, "127.0.0.1", 29500, "x")
    base = {"PATH": "/bin", "HF_TOKEN": "secret"}
    env = worker_env(base, topo, FOUR_GPUS, job_file=tmp_path / "job.json", status_dir=tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["OMP_NUM_THREADS"] == "8"  # 32 CPUs / 4 ranks
    assert env["DS_ACCELERATOR"] == "cuda"
    assert env["ZT_JOB_FILE"] == str(tmp_path / "job.json")
    assert env["ZT_STATUS_DIR"] == str(tmp_path)
    assert env["HF_TOKEN"] == "secret" and env["PATH"] == "/bin"  # inherited, not dropped
    assert base == {"PATH": "/bin", "HF_TOKEN": "secret"}  # the caller's dict is untouched

    cpu = worker_env({"OMP_NUM_THREADS": "3"}, Topology(1, 0, 2, "h", 1, "x"), cpu_only(),
                     job_file="j", status_dir="s")  # fmt: skip
    assert cpu["DS_ACCELERATOR"] == "cpu"
    assert cpu["OMP_NUM_THREADS"] == "3"  # the user's choice stands


@pytest.mark.parametrize(
    ("code", "ranks", "signalled", "expected"),
    [
        (0, [0, 0], False, 0),
        (0, [], False, 0),
        (1, [0, 2], False, 2),
        (1, [3], False, 3),
        (1, [2, 3], False, 2),
        (1, [4, 4], False, 4),  # diverged: every rank decides alike
        (1, [4, 2], False, 2),
        (1, [143, 143], True, 143),
        (1, [143, 143], False, 1),
        (1, [143], True, 143),
        (1, [143, 1], True, 1),
        (1, [0, 0], False, 1),  # torchrun failed though every rank said 0
        (1, [], True, 1),
    ],
)
def test_exit_code_mapping(code, ranks, signalled, expected):
    statuses = [RankStatus(i, c) for i, c in enumerate(ranks)]
    assert exit_code(code, statuses, signalled=signalled) == expected


# --- real processes: torchrun with two gloo ranks ---------------------------------------------

WORKER = textwrap.dedent(
    """
    import atexit, os, signal, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from zerotuner.launch.records import write_rank_armed, write_rank_status

    mode, rank = os.environ["TEST_MODE"], int(os.environ["RANK"])
    out = Path(os.environ["TEST_OUT"])
    dist.init_process_group("gloo")
    # as the worker does: a gloo group left to interpreter teardown can abort the exit
    atexit.register(dist.destroy_process_group)
    dist.barrier()

    def stop(signum, frame):
        if mode == "stubborn":
            return  # ignores SIGTERM: only a kill stops it
        time.sleep(0.5)  # "saving a checkpoint"
        (out / f"saved-{rank}").write_text("ok")
        write_rank_status(rank, 143, "stopped by signal after checkpoint")
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    write_rank_armed(rank)  # as the worker's StopRequest: a SIGTERM now is handled
    if mode == "ok":
        write_rank_status(rank, 0)
        sys.exit(0)
    if mode == "config" and rank == 1:
        write_rank_status(rank, 2, "ZT_X=1: bad")
        sys.exit(2)
    if mode == "unfit" and rank == 0:
        write_rank_status(rank, 3, "offload volume too small")
        sys.exit(3)
    if mode == "crash" and rank == 1:
        raise RuntimeError("boom")
    if mode == "allreduce":
        import torch

        total = torch.ones(1)
        dist.all_reduce(total)
        (out / f"sum-{rank}").write_text(f"{int(total.item())} {os.environ['WORLD_SIZE']}")
        write_rank_status(rank, 0)
        sys.exit(0)
    (out / f"ready-{rank}").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)
    """
)


def _setup(tmp_path: Path, mode: str) -> tuple[Path, Path, dict[str, str]]:
    script_dir = tmp_path / "pkg"
    script_dir.mkdir()
    (script_dir / "fake_worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    status = tmp_path / "status"
    status.mkdir()
    (status / "rank-0.json").write_text('{"rank": 0, "exit_code": 2, "message": "old run"}')
    base = dict(os.environ, TEST_MODE=mode, TEST_OUT=str(out))
    base["PYTHONPATH"] = os.pathsep.join([str(script_dir), *sys.path])
    return out, status, base


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, mode: str, *, signals: int = 0, grace: float = 30) -> tuple[int, Path]:
    out, status, base = _setup(tmp_path, mode)
    topo = Topology(1, 0, 2, "127.0.0.1", _port(), "test")

    def send():
        deadline = time.monotonic() + 120
        while len(list(out.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)

    sender = threading.Thread(target=send, daemon=True)
    if signals:
        sender.start()
    code = launch(
        topo, cpu_only(cpu_count=2), job_file=tmp_path / "job.json", status_dir=status,
        grace_seconds=grace, environ=base, module="fake_worker",
    )  # fmt: skip
    return code, out


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "expected"), [("ok", 0), ("config", 2), ("crash", 1)])
def test_run_ranks_maps_rank_outcomes(tmp_path, capfd, mode, expected):
    code, _ = _launch(tmp_path, mode)
    assert code == expected
    # a real failure keeps the rank's own traceback
    assert ("RuntimeError: boom" in capfd.readouterr().err) == (mode == "crash")


@pytest.mark.slow
def test_sigterm_reaches_every_rank_which_saves_and_exits_143(tmp_path, capfd):
    code, out = _launch(tmp_path, "sigterm", signals=1)
    assert code == 143
    assert sorted(p.name for p in out.glob("saved-*")) == ["saved-0", "saved-1"]
    # a requested stop is no crash: torchrun prints no traceback of its SignalException
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Sending process" in err, err[-3000:]


@pytest.mark.slow
def test_second_signal_kills_every_rank_at_once(tmp_path):
    code, out = _launch(tmp_path, "stubborn", signals=2, grace=600)
    assert code == 1  # no checkpoint confirmed: a retry must not count on one
    pids = [int(p.read_text()) for p in out.glob("ready-*")]
    assert len(pids) == 2
    # SIGKILLed, not waited out (grace 600 s): gone within moments of the launcher returning
    # (the kernel may still be tearing a process down as it returns)
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            alive.append(psutil.Process(pid))
    _, running = psutil.wait_procs(alive, timeout=10)
    assert all(p.status() == "zombie" for p in running if p.is_running())


@pytest.mark.slow
def test_a_signal_just_before_torchrun_starts_reaches_torchrun(tmp_path, monkeypatch):
    """SIGTERM after the launcher decided to start torchrun but before torchrun exists: it is
    held and sent on, so torchrun (in a session of its own) is not left running alone."""
    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen_after_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler right here
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen_after_a_signal)
    code, out = _launch(tmp_path, "sigterm")
    (torchrun,) = started
    # torchrun got it while starting up (before its own handlers): it ended, no rank began,
    # so it is a stop with nothing to resume from (143), not a crash
    assert torchrun.returncode == -signal.SIGTERM
    assert code == 143 and not list(out.glob("ready-*"))


# --- zerotuner check: the dry run of everything train validates -------------------------------


def _check(capsys) -> tuple[int, str]:
    from zerotuner import cli

    code = cli.main(["check"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_check_passes_on_the_demo(demo_job_env, capsys, tmp_path):
    code, out = _check(capsys)
    assert code == 0, out
    for name in ("settings", "hardware", "topology", "model", "plan", "deepspeed config",
                 "dataset", "offload", "output dir", "metrics port"):  # fmt: skip
        assert any(line.startswith("OK") and f" {name} " in line for line in out.splitlines())
    assert "1 node(s) x 2 rank(s)" in out
    assert not (tmp_path / "output").exists()  # check creates nothing


@pytest.mark.parametrize(
    ("env", "failing", "expected"),
    [
        ({"ZT_DATA_DIR": "/nonexistent/data"}, "dataset", 2),
        ({"ZT_MODEL": "/nonexistent/model"}, "model", 2),
        ({"ZT_MODEL": "not a hub id!"}, "model", 2),
        ({"ZT_MODEL": "someone/not-cached-sdxl"}, "model", 2),  # offline (conftest), not cached
        ({"ZT_NNODES": "2"}, "topology", 2),
        ({"ZT_ZERO_STAGE": "1", "ZT_OFFLOAD_PARAM": "cpu"}, "plan", 2),
        ({"ZT_TRAIN_BATCH_SIZE": "0"}, "settings", 2),
    ],
)
def test_check_reports_config_errors_with_exit_2(demo_job_env, capsys, env, failing, expected):
    for key, value in env.items():
        demo_job_env.setenv(key, value)
    code, out = _check(capsys)
    assert code == expected, out
    assert any(line.startswith("FAIL") and f" {failing} " in line for line in out.splitlines())


def test_check_busy_port_is_exit_3(demo_job_env, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        demo_job_env.setenv("ZT_METRICS_HOST", "127.0.0.1")
        demo_job_env.setenv("ZT_METRICS_PORT", str(busy.getsockname()[1]))
        code, out = _check(capsys)
    assert code == 3, out
    assert "in use" in out


def test_check_busy_rendezvous_port_on_node_0_is_exit_3(demo_job_env, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for key, value in dict(ZT_NNODES="2", ZT_NODE_RANK="0", ZT_MASTER_ADDR="127.0.0.1",
                               ZT_MASTER_PORT=str(busy.getsockname()[1])).items():  # fmt: skip
            demo_job_env.setenv(key, value)
        code, out = _check(capsys)
    assert code == 3, out
    assert any(line.startswith("FAIL") and " rendezvous port " in line for line in out.splitlines())
    assert "ZT_MASTER_PORT=" in out and "in use" in out


def test_check_validates_nvme_offload_without_cleaning(demo_job_env, capsys, tmp_path):
    demo_job_env.setenv("ZT_ZERO_STAGE", "3")
    demo_job_env.setenv("ZT_OFFLOAD_OPTIMIZER", "nvme")
    stale = tmp_path / "offload" / "zero_stage_3" / "optimizer" / "rank0" / "1.tensor.swp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    code, out = _check(capsys)
    assert code == 0, out
    assert "O_DIRECT ok" in out
    assert stale.exists()  # check mode never deletes


NODE = """
import sys
from pathlib import Path
from zerotuner.machine.hardware import cpu_only
from zerotuner.launch.ranks import Topology, launch

port, status, job = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
topo = Topology(2, 1, 1, "127.0.0.1", port, "test")
code = launch(topo, cpu_only(cpu_count=1), job_file=job, status_dir=status, grace_seconds=30,
              module="fake_worker")
sys.exit(code)
"""


@pytest.mark.slow
def test_two_nodes_on_localhost_form_one_job(tmp_path):
    """Node 1 in another process, node 0 here: static rendezvous through --node-rank."""
    import subprocess

    out, status0, base = _setup(tmp_path, "allreduce")
    status1 = tmp_path / "status-node1"
    port = _port()
    node1 = subprocess.Popen(
        [sys.executable, "-c", NODE, str(port), str(status1), str(tmp_path / "job.json")],
        env=base,
    )
    try:
        code0 = launch(
            Topology(2, 0, 1, "127.0.0.1", port, "test"), cpu_only(cpu_count=1),
            job_file=tmp_path / "job.json", status_dir=status0, grace_seconds=30,
            environ=base, module="fake_worker",
        )  # fmt: skip
        code1 = node1.wait(timeout=120)
    finally:
        node1.kill()
    assert (code0, code1) == (0, 0)
    assert sorted(p.read_text() for p in out.glob("sum-*")) == ["2 2", "2 2"]
    assert [p.name for p in status0.glob("rank-*.json")] == ["rank-0.json"]
    assert [p.name for p in status1.glob("rank-*.json")] == ["rank-1.json"]


def test_check_sizes_the_text_cache_against_the_free_space(
    demo_job_env, flow_demo_dirs, capsys, monkeypatch
):
    import zerotuner.machine.offload_volume
    from zerotuner.data.scan import scan

    flux = flow_demo_dirs["flux"]
    monkeypatch.setenv("ZT_MODEL", str(flux / "model"))
    monkeypatch.setenv("ZT_DATA_DIR", str(flux / "data"))
    captions = len({item.caption for item in scan(flux / "data", log_skipped=False).items})
    code, out = _check(capsys)
    (line,) = [line for line in out.splitlines() if " text cache " in line]
    assert code == 0 and line.startswith("OK") and f" {captions} captions x " in line, out
    assert "GiB free" in line
    # a full disk
    monkeypatch.setattr(zerotuner.machine.offload_volume, "free_bytes_at", lambda path: 0)
    code, out = _check(capsys)
    (line,) = [line for line in out.splitlines() if " text cache " in line]
    assert code == 3 and line.startswith("FAIL") and "ZT_CACHE_DIR" in line
