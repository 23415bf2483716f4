"""Start-up and per-step work that is not the model's: ranks started before the plan (they wait
for the job file, and a refused plan or a signal leaves none behind), one rank without
torchrun's agent, DeepSpeed's all-reduce skipped for a lone ZeRO-0 rank (same parameters),
and py-cpuinfo asked once per process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from trainkit import ENTRYPOINT, entrypoint_env, lone_rank_result

from zerotuner.errors import StoppedBeforeStart
from zerotuner.launch.job import LAUNCHER_PID_ENV, wait_for_job
from zerotuner.launch.ranks import Topology, free_port, start_ranks
from zerotuner.launch.records import read_rank_statuses
from zerotuner.machine.hardware import cpu_only
from zerotuner.train import speed

# A rank that waits for its job file like the worker, then reports what it found and who
# started it (its parent: the launcher itself when there is one rank, else torchrun).
WAITER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from zerotuner.launch.job import wait_for_job
    from zerotuner.launch.records import write_rank_status

    rank, out = int(os.environ["RANK"]), Path(os.environ["TEST_OUT"])
    (out / f"waiting-{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    job = wait_for_job()

    def stop(signum, frame):
        write_rank_status(rank, 143, "stopped by signal after checkpoint")
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    (out / f"started-{rank}").write_text(job.read_text())
    if os.environ.get("TEST_MODE") == "wait":
        while True:
            time.sleep(0.1)
    write_rank_status(rank, 0, "done")
    """
)


def _ranks(tmp_path: Path, nproc: int, mode: str = "exit"):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "waiter.py").write_text(WAITER)
    out = tmp_path / "out"
    out.mkdir()
    environ = dict(os.environ, TEST_OUT=str(out), TEST_MODE=mode)
    environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "pkg"), *sys.path])
    ranks = start_ranks(
        Topology(1, 0, nproc, "127.0.0.1", free_port(), "test"), cpu_only(cpu_count=2),
        job_file=tmp_path / "job.json", status_dir=tmp_path / "status", grace_seconds=30,
        environ=environ, module="waiter",
    )  # fmt: skip
    return ranks, out


def _waiting(out: Path, n: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + 120
    while len(list(out.glob("waiting-*"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [tuple(map(int, p.read_text().split())) for p in sorted(out.glob("waiting-*"))]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_ranks_started_early_wait_for_the_job_then_run(tmp_path, nproc):
    ranks, out = _ranks(tmp_path, nproc)
    try:
        waiting = _waiting(out, nproc)
        time.sleep(0.5)
        assert not list(out.glob("started-*"))  # nothing runs before the plan is written
        (tmp_path / "job.json").write_text('{"planned": true}')
        ranks.release()
        assert ranks.wait() == 0
    finally:
        ranks.cancel()
    started = [(out / f"started-{r}").read_text() for r in range(nproc)]
    assert started == ['{"planned": true}'] * nproc
    # one rank runs as the launcher's own child: no torchrun agent in between
    assert (ranks.launcher == "the rank") == (nproc == 1)
    assert all((parent == os.getpid()) == (nproc == 1) for _, parent in waiting)


@pytest.mark.slow
def test_a_refused_plan_leaves_no_waiting_rank(tmp_path):
    ranks, out = _ranks(tmp_path, 2)
    pids = [pid for pid, _ in _waiting(out, 2)]
    ranks.cancel()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert ranks.proc.poll() is not None and read_rank_statuses(tmp_path / "status") == []


@pytest.mark.slow
def test_a_signal_while_planning_stops_before_training(tmp_path):
    """Before the job file: the signal ends the planning (the caller cancels the ranks). After
    it: forwarded to the rank, which stops as after a checkpoint (143)."""
    ranks, out = _ranks(tmp_path, 1, mode="wait")
    try:
        _waiting(out, 1)
        with pytest.raises(StoppedBeforeStart, match="stopped by SIGTERM before training"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread, here
    finally:
        ranks.cancel()
    assert StoppedBeforeStart("x").exit_code == 143

    again = tmp_path / "again"
    again.mkdir()
    ranks, out = _ranks(again, 1, mode="wait")
    (again / "job.json").write_text("{}")
    ranks.release()
    threading.Thread(target=_signal_when, args=(out / "started-0",), daemon=True).start()
    assert ranks.wait() == 143


def _signal_when(path: Path) -> None:
    deadline = time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_rank_whose_launcher_died_stops_waiting(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(dead.pid))
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        wait_for_job(tmp_path / "never.json")
    assert stopped.value.code == 1 and time.monotonic() - started < 5


@pytest.mark.slow
def test_entrypoint_refusing_the_plan_leaves_no_rank_behind(demo_dir, tmp_path):
    """The ranks start before preflight; a plan that cannot run (exit 3: nothing fits the host)
    ends them."""
    env = entrypoint_env(demo_dir, tmp_path, ZT_RESOLUTION="4096", ZT_TRAIN_BATCH_SIZE="512")
    proc = subprocess.Popen([ENTRYPOINT, "train"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 3 and "nothing fits" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    left = []
    for p in psutil.process_iter(["environ"]):
        try:
            if (p.info["environ"] or {}).get(LAUNCHER_PID_ENV) == str(proc.pid):
                left.append(p)
        except psutil.Error:
            continue
    assert not left, [p.cmdline() for p in left]


def test_cpu_info_is_asked_once_however_many_callers():
    calls = []

    def ask():
        calls.append(threading.get_ident())
        time.sleep(0.2)
        if len(calls) == 1:
            raise OSError("first try fails")  # not kept: the next caller asks again
        return {"arch": "X86_64", "flags": ["avx2"]}

    once = speed._once(ask)
    with pytest.raises(OSError):
        once()
    threads = [threading.Thread(target=once) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert once() == {"arch": "X86_64", "flags": ["avx2"]} and len(calls) == 2


# A lone rank at ZeRO-0 with and without DeepSpeed's all-reduce: the same parameters after
# three AdamW steps with clipping; at ZeRO-1 the reduction stays (its optimizer steps on it).
# Then DeepSpeed's ZeRO-0 clip against the foreach one, with the clip binding (norm 0.05) and
# not (norm 100): the same parameters, and the norm reported to the engine.
LONE = textwrap.dedent(
    """
    import json, os, sys
    import deepspeed, torch
    from zerotuner.train import speed

    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for stage, skip, foreach, clip in ((0, False, False, 0.05), (0, True, False, 0.05),
                                       (1, True, True, 0.05), (0, True, True, 0.05),
                                       (0, True, False, 100.0), (0, True, True, 100.0)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        skipped = speed.skip_lone_allreduce(engine) if skip else False
        clipped = speed.foreach_clip(engine) if foreach else False
        gen = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(3):
            x = torch.randn(4, 8, generator=gen)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            grads = [p.grad for p in model.parameters() if p.grad is not None]  # ZeRO-1: none
            expected = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
            engine.step()
            norm = engine.get_global_grad_norm()
            norms.append([float(expected), None if norm is None else float(norm)])
        result[f"{stage}-{skip}-{foreach}-{clip}"] = {"skipped": skipped, "foreach": clipped,
            "allreduce": engine.enable_backward_allreduce, "norms": norms,
            "params": [p.detach().flatten().tolist() for p in model.parameters()]}
    print("RESULT " + json.dumps(result))
    """
)


@pytest.mark.slow
def test_a_lone_zero0_rank_skips_the_all_reduce_and_clips_with_foreach_kernels(tmp_path):
    result = lone_rank_result(tmp_path, LONE, timeout=300)
    kept, skipped, zero1 = (
        result["0-False-False-0.05"],
        result["0-True-False-0.05"],
        result["1-True-True-0.05"],
    )
    assert kept["allreduce"] and not kept["skipped"]
    assert skipped["skipped"] and not skipped["allreduce"]
    assert skipped["params"] == kept["params"]  # bit for bit: a group of one changes nothing
    assert not zero1["skipped"] and zero1["allreduce"]
    assert not zero1["foreach"]  # ZeRO-1 clips its own flat partition
    ds, fe = skipped, result["0-True-True-0.05"]
    assert fe["foreach"] and all(e > 0.05 for e, _ in fe["norms"])  # the clip binds every step
    assert ds["norms"][0][1] is None  # DeepSpeed's ZeRO-0 clip reports no norm
    assert [n for _, n in fe["norms"]] == pytest.approx([e for e, _ in fe["norms"]], rel=1e-6)
    for a, b in zip(fe["params"], ds["params"], strict=True):  # the norm is summed in another
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)  # order: the same to float tolerance
    loose_ds, loose_fe = result["0-True-False-100.0"], result["0-True-True-100.0"]
    assert loose_fe["foreach"] and all(e < 100.0 for e, _ in loose_fe["norms"])
    assert loose_fe["params"] == loose_ds["params"]  # a factor of 1 skipped: bit for bit


def _extensions_copy(tmp: Path) -> Path:
    """This machine's built DeepSpeed ops in a folder of the test's own, copied with their
    times (nothing rebuilds an op that is up to date). Copies, not hard links: a build in the
    copy would write through a link into the ops every other test loads, and their loaders
    would relink or fail while it does."""
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    copy = tmp / "torch_extensions"
    shutil.copytree(root, copy, copy_function=shutil.copy2)
    return copy


@pytest.mark.slow
def test_a_stale_op_build_lock_is_removed_not_waited_on(demo_dir, tmp_path):
    """Issue 40: a start killed while DeepSpeed JIT-built an op left `lock` in its build folder;
    every later start waited on it forever, silently. The entrypoint removes a lock no live
    build holds, in one line, and the run goes on."""
    extensions = _extensions_copy(tmp_path)
    hour_ago = time.time() - 3600
    for op in ("deepspeed_shm_comm", "fused_adam"):
        lock = extensions / op / "lock"
        lock.touch()
        # The lock alone is aged: an hour-old .o would make ninja rebuild the op
        os.utime(lock, (hour_ago, hour_ago))
    env = entrypoint_env(demo_dir, tmp_path, ZT_MAX_STEPS="1", ZT_CHECKPOINT_EVERY_STEPS="0",
                         TORCH_EXTENSIONS_DIR=str(extensions))  # fmt: skip
    proc = subprocess.run([ENTRYPOINT, "train"], env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("removed a stale lock of an interrupted DeepSpeed op build") == 2, out
    assert not list(extensions.glob("*/lock"))


def test_a_lock_a_build_holds_is_waited_on_with_a_line_and_a_bound(tmp_path, caplog):
    from zerotuner.machine.ops import clear_stale_locks

    caplog.set_level("INFO")
    (tmp_path / "cpu_adam").mkdir()
    lock = tmp_path / "cpu_adam" / "lock"
    lock.touch()  # just now: a build may be writing there
    started = time.monotonic()
    assert clear_stale_locks(tmp_path, quiet_seconds=1, wait_seconds=30, poll=0.1) == [lock]
    assert 0.5 < time.monotonic() - started < 10
    assert "waiting for the DeepSpeed op build" in caplog.text
    busy = subprocess.Popen(["sleep", "30"], cwd=lock.parent)  # ninja's place: the build folder
    try:
        lock.touch()
        assert clear_stale_locks(tmp_path, quiet_seconds=0, wait_seconds=1, poll=0.1) == []
        assert lock.exists() and "still held by a build after 1 s" in caplog.text
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.slow
def test_a_sigterm_as_the_ranks_start_is_a_stop_not_a_crash(demo_dir, tmp_path):
    """Issue 40: SIGTERM just after the ranks were released, before a rank installed its
    handler (it was still importing), ended with exit 1 ("the rank exited -15"): a crash to an
    orchestrator. It is a stop with nothing to resume from: 143, said in one line. (The signal
    may also land between the "launching" line and the ranks' release, on a busy machine: the
    entrypoint then stops them itself, "stopped by SIGTERM before training: exit 143".)"""
    env = entrypoint_env(demo_dir, tmp_path, ZT_MAX_STEPS="2")
    log_path = tmp_path / "log.txt"
    with log_path.open("w") as log:
        proc = subprocess.Popen([ENTRYPOINT, "train"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "launching 2 rank(s)" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text()
    assert any("before training" in line and "exit 143" in line for line in out.splitlines()), out[
        -3000:
    ]
    assert "Traceback" not in out, out[-3000:]
