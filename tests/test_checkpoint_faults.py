"""Faults around checkpoints, with real ranks on the CPU: SIGKILL inside a save, SIGTERM then a
restart on another topology, a full disk, corrupt and truncated files. Every trial prints a
`fault:` line (survived, steps lost) for the figures in docs/operations.md."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

from zerotuner.weights import checkpoint
from zerotuner.weights.checkpoint import find_resume, read_manifest, verify

UNET = "unet/diffusion_pytorch_model.safetensors"


def _commit(path: Path, step: int, files: dict[str, bytes]) -> None:
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    manifest = {
        "step": step,
        "files": {n: len(d) for n, d in files.items()},
        "sha256": {n: checkpoint._sha256(path / n) for n in files},
    }
    (path / "zerotuner.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "missing"])
def test_damaged_checkpoint_is_skipped_with_a_message(tmp_path, caplog, damage) -> None:
    root = tmp_path / "checkpoints"
    files = {"mp_rank_00_model_states.pt": os.urandom(4096), "ema.safetensors": b"x" * 100}
    _commit(root / "step-2", 2, files)
    _commit(root / "step-4", 4, files)
    (root / "latest").write_text("step-4")
    assert find_resume("auto", tmp_path) == root / "step-4"
    shard = root / "step-4" / "mp_rank_00_model_states.pt"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[:1000])
    elif damage == "corrupt":  # same size, one flipped byte
        shard.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    else:
        shard.unlink()
    checkpoint._VERIFIED.clear()
    assert verify(root / "step-4") is not None
    assert find_resume("auto", tmp_path) == root / "step-2"
    assert f"skipping checkpoint {root / 'step-4'}" in caplog.text
    assert verify(root / "step-2") is None
    print(f"fault: {damage} checkpoint survived, lost 2 steps (fell back to step-2)")


# --- real processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir, cache) -> Path:
    """An uninterrupted 4-step ZeRO-2 run on 2 ranks (checkpoints at 2 and 4)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc, output = tk.train(tmp, demo_dir, cache, stage=2, steps=4, checkpoint_every_steps=2)
    tk.assert_ok(proc, tmp)
    return output


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _start(
    tmp: Path, demo: Path, cache: Path, *, stage: int, steps: int, world: int = 2,
    extra_env: dict[str, str] | None = None, **settings,
) -> tuple[subprocess.Popen, Path]:  # fmt: skip
    output = tmp / "output"
    config = tk.ds_config(stage, world=world, steps=steps)
    job = tk.write_job(tmp / "job.json", model=demo / "model", deepspeed=config, world=world)
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, **settings,
    )  # fmt: skip
    cmd, full = tk.rank_command(tmp, env, job_file=job, world=world)
    log = (tmp / "log.txt").open("w")
    proc = subprocess.Popen(
        cmd, env={**full, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT, cwd=tmp
    )
    return proc, output


def _wait(proc: subprocess.Popen, tmp: Path, ready, what: str) -> None:
    for _ in range(1200):  # up to 10 minutes on a busy machine
        if ready():
            return
        assert proc.poll() is None, (
            f"exited before {what}:\n" + (tmp / "log.txt").read_text()[-4000:]
        )
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _same_step2_and_close_final(output: Path, reference: Path) -> None:
    """The checkpoint resumed from holds exactly the uninterrupted run's step-2 weights; the
    end of the run matches it up to float rounding."""
    name = "checkpoints/step-2/mp_rank_00_model_states.pt"
    got = torch.load(output / name, map_location="cpu", weights_only=False)["module"]
    want = torch.load(reference / name, map_location="cpu", weights_only=False)["module"]
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # not bit for bit: DeepSpeed's CPU Adam keeps beta^t as a running product inside a process
    # but computes it with pow() after a restart (last-bit different), and Adam turns that
    # noise on ~zero gradients (biases before a GroupNorm) into lr-sized steps: compare on
    # average against the size of the training
    final, want = load_file(output / "final" / UNET), load_file(reference / "final" / UNET)
    drift = torch.cat([(final[k] - want[k]).abs().flatten() for k in want]).mean().item()
    update = torch.cat([(want[k] - got[k]).abs().flatten() for k in want]).mean().item()
    assert drift < 1e-3 * update, (drift, update)


@pytest.mark.slow
def test_sigkill_inside_a_save_resumes_from_the_previous_commit(
    tmp_path, demo_dir, cache, reference
) -> None:
    """A rank killed while step-4 is half written: step-4 is never resumed, the restart
    continues from step-2 and ends with exactly the uninterrupted run's weights."""
    proc, output = _start(
        tmp_path, demo_dir, cache, stage=2, steps=4, checkpoint_every_steps=2,
        extra_env={"ZT_TEST_SLEEP_IN_SAVE": "4"},
    )  # fmt: skip
    step4 = output / "checkpoints" / "step-4"
    try:
        _wait(proc, tmp_path, lambda: any(step4.glob("*optim_states.pt")), "the step-4 shards")
        ranks = _children(proc.pid)
        assert ranks, "no rank processes under torchrun"
        os.kill(ranks[-1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert read_manifest(step4) is None, "a killed save must not be committed"
    assert find_resume("auto", output) == output / "checkpoints" / "step-2"

    restart = tmp_path / "restart"
    restart.mkdir()
    again, _ = tk.train(restart, demo_dir, cache, stage=2, steps=4, output=output,
                        checkpoint_every_steps=2)  # fmt: skip
    tk.assert_ok(again, restart)
    assert "resumed from" in again.stdout + again.stderr
    steps = [s["step"] for s in tk.read_steps(output)]
    assert steps[-2:] == [3, 4]
    _same_step2_and_close_final(output, reference)
    print("fault: SIGKILL in save survived, lost 2 steps (resumed at step-2)")


@pytest.mark.slow
def test_a_save_replacing_a_committed_step_keeps_it_until_the_new_one_commits(
    tmp_path, demo_dir, cache, reference
) -> None:
    """ZT_RESUME=never over an earlier run's output saves step-2 again: the committed step-2
    waits aside, so a rank killed inside the new save loses nothing; the next start puts the
    old step-2 back, byte for byte."""
    output = tmp_path / "output"
    shutil.copytree(reference, output)
    step2 = output / "checkpoints" / "step-2"
    before = read_manifest(step2)
    proc, _ = _start(
        tmp_path, demo_dir, cache, stage=2, steps=2, resume="never",
        extra_env={"ZT_TEST_SLEEP_IN_SAVE": "4"},
    )  # fmt: skip
    aside = output / "checkpoints" / ".step-2.replaced"
    try:
        _wait(proc, tmp_path, lambda: aside.is_dir() and any(step2.glob("*optim_states.pt")),
              "the new step-2 shards")  # fmt: skip
        os.kill(_children(proc.pid)[-1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and read_manifest(step2) is None
    assert read_manifest(aside) == before

    restart = tmp_path / "restart"
    restart.mkdir()
    again, _ = tk.train(restart, demo_dir, cache, stage=2, steps=4, output=output)
    tk.assert_ok(again, restart)
    assert "restored" in again.stdout + again.stderr and not aside.exists()
    assert read_manifest(step2) == before and verify(step2) is None
    print("fault: SIGKILL in a save replacing a committed step survived, lost 0 checkpoints")


@pytest.mark.slow
def test_sigterm_then_restart_on_one_rank_and_zero3(tmp_path, demo_dir, cache, reference) -> None:
    """SIGTERM at some step: committed, exit 143; the restart on 1 rank with ZeRO-3 continues
    at the next step (steps.jsonl has no gap and no repeat)."""
    proc, output = _start(tmp_path, demo_dir, cache, stage=2, steps=500, checkpoint_every_steps=0)
    steps_file = output / "run" / "steps.jsonl"
    try:
        _wait(
            proc, tmp_path,
            lambda: steps_file.is_file() and len(steps_file.read_text().splitlines()) >= 2,
            "two steps",
        )  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    codes = {rank: s["exit_code"] for rank, s in tk.statuses(tmp_path).items()}
    assert codes == {0: 143, 1: 143}, (tmp_path / "log.txt").read_text()[-4000:]
    last = tk.read_steps(output)[-1]["step"]
    assert (output / "checkpoints" / "latest").read_text() == f"step-{last}"

    restart = tmp_path / "restart"
    restart.mkdir()
    again, _ = tk.train(restart, demo_dir, cache, stage=3, steps=last + 2, world=1, output=output)
    tk.assert_ok(again, restart, world=1)
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, last + 3))
    print(f"fault: SIGTERM at step {last} survived, lost 0 steps (resumed on 1 rank, ZeRO-3)")


@pytest.mark.slow
def test_disk_full_while_saving(tmp_path, demo_dir, cache, reference) -> None:
    """A 24 MB tmpfs holds the step-2 checkpoint (16 MB) but not step-4 beside it: one clear
    line, exit 3, no traceback from the rank, step-2 intact and resumable."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    output = tmp_path / "output"
    output.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(output)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        proc, _ = tk.train(tmp_path, demo_dir, cache, stage=2, steps=4, output=output,
                           checkpoint_every_steps=2, checkpoints_keep=1)  # fmt: skip
        codes = {s["exit_code"] for s in tk.statuses(tmp_path).values()}
        assert 3 in codes, proc.stderr[-4000:]
        errors = [x for x in proc.stderr.splitlines() if x.startswith("zerotuner: error:")]
        assert errors and "no space left" in errors[0] and "step-2" in errors[0], errors
        # the rank that hit the full disk says so in one line (the other rank then loses its
        # peer inside the save and torchrun stops it: that one exits 1)
        assert "unexpected pos" not in proc.stderr and "Errno 28" not in proc.stderr
        previous = output / "checkpoints" / "step-2"
        assert verify(previous) is None
        assert not (output / "checkpoints" / "step-4").exists()
        saved = tmp_path / "saved"
        subprocess.run(["cp", "-a", str(output), str(saved)], check=True)
    finally:
        subprocess.run(["umount", str(output)], check=False)
    restart = tmp_path / "restart"
    restart.mkdir()
    again, _ = tk.train(restart, demo_dir, cache, stage=2, steps=4, output=saved,
                        checkpoint_every_steps=2)  # fmt: skip
    tk.assert_ok(again, restart)
    _same_step2_and_close_final(saved, reference)
    print("fault: disk full survived, lost 2 steps (resumed at step-2 elsewhere)")
