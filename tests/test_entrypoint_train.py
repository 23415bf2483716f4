"""`./entrypoint train` as the image runs it: real processes, real DeepSpeed on the CPU.

Two entrypoints on 127.0.0.1 train together as node 0 and node 1; SIGTERM to the entrypoint
reaches the ranks, which commit a checkpoint and exit 143; a rank SIGKILLed is exit 1 naming
it; bad settings exit 2 and an unfit environment exits 3, each with one line and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from trainkit import ENTRYPOINT, entrypoint_env, sigterm_after_steps, steps_done

from bench.receiver import Receiver
from zerotuner.launch.ranks import free_port


def hub_cache(model: Path, hub: Path, repo: str) -> None:
    """`model` as the Hugging Face cache holds a downloaded hub repository: what
    snapshot_download finds offline, through the same code path as a real download."""
    revision = "0" * 40
    folder = hub / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, folder / "snapshots" / revision)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)


@pytest.mark.slow
def test_two_entrypoints_on_localhost_train_together(demo_dir, tmp_path):
    """Two nodes, one rank each, training a model named by its hub id (from the cache)."""
    port = str(free_port())
    hub_cache(demo_dir / "model", tmp_path / "hf" / "hub", "zerotuner/tiny-sdxl")
    common = dict(ZT_NNODES="2", ZT_NUM_PROCESSES="1", ZT_MASTER_ADDR="127.0.0.1",
                  ZT_MASTER_PORT=port, ZT_MAX_STEPS="4", ZT_CHECKPOINT_EVERY_STEPS="0",
                  ZT_MODEL="zerotuner/tiny-sdxl", HF_HOME=str(tmp_path / "hf"),
                  HF_HUB_OFFLINE="1")  # fmt: skip
    nodes = [
        subprocess.Popen(
            [ENTRYPOINT, "train"],
            env=entrypoint_env(demo_dir, tmp_path, ZT_NODE_RANK=str(rank), **common),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "node 0 of 2 (world size 2" in logs[0] and "node 1 of 2 (world size 2" in logs[1]
    # what was decided and why; the hub id was found in the cache, so nothing to download
    assert "model family sdxl (detected from" in logs[0], logs[0][-3000:]
    for line in ("plan:", "effective DeepSpeed config:", "phase: loading"):
        assert line in logs[0], line
    assert [s["step"] for s in steps_done(tmp_path)] == [1, 2, 3, 4]
    effective = json.loads((tmp_path / "output" / "run" / "deepspeed.json").read_text())
    micro = effective["train_micro_batch_size_per_gpu"]
    assert effective["train_batch_size"] == micro * effective["gradient_accumulation_steps"] * 2
    assert (tmp_path / "output" / "final" / "model_index.json").is_file()


@pytest.mark.slow
def test_sigterm_to_the_entrypoint_reaches_the_ranks_and_exits_143(demo_dir, tmp_path):
    with Receiver() as webhook:  # ZT_NOTIFY_URL (issue 46): the stop is told, with its code
        env = entrypoint_env(demo_dir, tmp_path, ZT_MAX_STEPS="10000",
                             ZT_CHECKPOINT_EVERY_STEPS="0", ZT_NOTIFY_URL=webhook.url)  # fmt: skip
        code, out = sigterm_after_steps(env, tmp_path)
    assert code == 143, out[-3000:]
    told = webhook.bodies[-1]
    assert told["type"] == "failure" and told["message"].startswith("exit 143: stopped by a"), told
    last = steps_done(tmp_path)[-1]["step"]
    pointer = tmp_path / "output" / "checkpoints" / "latest"
    assert pointer.is_file(), out[-3000:]
    assert pointer.read_text().strip().endswith(f"step-{last}")
    # a requested stop is no crash: no traceback from torchrun, the ranks or the entrypoint
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_sigterm_before_training_exits_143_once_caching_ends(demo_dir, tmp_path):
    """Signalled while loading (a hub download, or caching a large dataset, takes long): the
    ranks finish caching, which a restart reuses, and stop before the engine and step 1."""
    env = entrypoint_env(demo_dir, tmp_path, ZT_MAX_STEPS="10000")
    proc = subprocess.Popen(
        [ENTRYPOINT, "train"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "phase: loading" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM before training: exit 143" in out, out[-3000:]
    assert steps_done(tmp_path) == []
    assert not (tmp_path / "output" / "checkpoints" / "latest").exists()
    assert json.loads((tmp_path / "output" / "run" / "cache.json").read_text())["latents_encoded"]


def run_entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ENTRYPOINT, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_config_error_exits_2_with_one_line(demo_dir, tmp_path):
    result = run_entrypoint(entrypoint_env(demo_dir, tmp_path, ZT_ZERO_STAGE="7"), "train")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["zerotuner: error: ZT_ZERO_STAGE=7: expected 'auto' or 0, 1, 2 or 3"]
    assert "Traceback" not in result.stderr


def test_an_unfit_environment_exits_3(demo_dir, tmp_path):
    result = run_entrypoint(entrypoint_env(demo_dir, tmp_path, ZT_DEVICE="cuda"), "train")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert any(line.startswith("zerotuner: error: ") for line in result.stderr.splitlines())


@pytest.mark.slow
def test_a_rank_the_oom_killer_ends_is_exit_1_and_named(demo_dir, tmp_path):
    """SIGKILL to one rank while it trains (what the kernel's out-of-memory killer sends):
    exit 1 (a retry may help), and the run's one line, the one the notification tells, names
    that rank and the signal, not its peer's broken connection."""
    from test_metrics_training import rank_processes

    with Receiver() as webhook:
        env = entrypoint_env(demo_dir, tmp_path, ZT_MAX_STEPS="10000",
                             ZT_CHECKPOINT_EVERY_STEPS="0", ZT_NOTIFY_URL=webhook.url)  # fmt: skip
        proc = subprocess.Popen(
            [ENTRYPOINT, "train"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while len(steps_done(tmp_path)) < 2:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            ranks = rank_processes(proc)
            assert len(ranks) == 2
            ranks[1].send_signal(signal.SIGKILL)
            out = proc.communicate(timeout=300)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]
    assert "ERROR zerotuner.train: rank 1 was killed by SIGKILL" in out, out[-3000:]
    told = webhook.bodies[-1]
    assert told["type"] == "failure", told
    assert told["message"].startswith(
        "exit 1: failed unexpectedly (a retry may help): rank 1 was killed by SIGKILL without "
        "a stop request: most often the kernel's out-of-memory killer"
    ), told
