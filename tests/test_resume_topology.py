"""A committed checkpoint resumes on another ZeRO stage and another number of ranks.

One uninterrupted ZeRO-2 run on 2 ranks is the reference. A chain of runs covers the same
steps, each resuming the previous one's checkpoint under another stage (2 -> 3 -> 0 -> 1 ->
2): with the same ranks the data and noise are the same, so the losses and final weights
match the reference only if weights, Adam moments, step count and LR schedule all carried
over. Then the checkpoint moves 2 ranks -> 1 -> 2 without training (max steps reached): the
export equals the checkpoint's weights. A ZeRO-3 run with the optimizer and parameters on NVMe
takes part in both directions, with stale (poisoned) swap files of an earlier run in its swap
folder. A conversion that fails on rank 0 stops every rank with the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

from zerotuner.weights.checkpoint import verify

pytestmark = pytest.mark.slow

UNET = "unet/diffusion_pytorch_model.safetensors"
CHAIN = (2, 3, 0, 1, 2)  # ZeRO stage of steps 1, 2, 3, 4, 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir, cache):
    tmp = tmp_path_factory.mktemp("reference")
    proc, output = tk.train(tmp, demo_dir, cache, stage=2, steps=len(CHAIN))
    tk.assert_ok(proc, tmp)
    return output


@pytest.fixture(scope="module")
def chain(tmp_path_factory, demo_dir, cache, reference):
    output = tmp_path_factory.mktemp("chain") / "output"
    logs = []
    for step, stage in enumerate(CHAIN, start=1):
        tmp = output.parent / f"run-{step}"
        tmp.mkdir()
        proc, _ = tk.train(tmp, demo_dir, cache, stage=stage, steps=step, output=output)
        tk.assert_ok(proc, tmp)
        logs.append(proc.stdout + proc.stderr)
    return output, logs


def _assert_follows(
    output: Path, reference: Path, demo: Path, logs: list[str], converted: list[bool]
) -> None:
    """Each run converted (or not) as expected; every step's loss and LR are the uninterrupted
    run's; the final weights (which show the last step's update) sit on the reference's."""
    assert ["converting once to universal/" in log for log in logs] == converted
    steps, expected = tk.read_steps(output), tk.read_steps(reference)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    for got, want in zip(steps, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (steps, expected)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-6)
    # Adam turns the rounding noise of ~zero gradients (biases before a GroupNorm) into
    # lr-sized steps, so a few weights differ between ZeRO layouts; on average they must sit
    # on the reference (lost Adam moments or a lost LR would differ by about a whole update)
    final, want = load_file(output / "final" / UNET), load_file(reference / "final" / UNET)
    base = load_file(demo / "model" / UNET)
    drift = torch.cat([(final[k] - want[k]).abs().flatten() for k in want]).mean().item()
    update = torch.cat([(want[k] - base[k]).abs().flatten() for k in want]).mean().item()
    print(f"vs reference: mean weight difference {drift:.2e}, mean update {update:.2e}")
    assert drift < 1e-3 * update, (drift, update)


def test_stage_changes_resume_everything(chain, reference, demo_dir) -> None:
    output, logs = chain
    # ZeRO 1 -> 2 is DeepSpeed's own load
    _assert_follows(output, reference, demo_dir, logs, [False, True, True, True, False])
    # every stage reports the gradient norm, ZeRO-0 (speed.foreach_clip) the same as ZeRO-2
    got, want = tk.read_steps(output), tk.read_steps(reference)
    assert [s["grad_norm"] for s in got] == pytest.approx([s["grad_norm"] for s in want], rel=1e-3)


def test_world_size_changes_keep_the_weights(chain, tmp_path, demo_dir, cache) -> None:
    source, _ = chain
    checkpoint = source / "checkpoints" / "step-5"
    saved = load_file(source / "final" / UNET)
    for world, stage in ((1, 3), (2, 0)):
        tmp = tmp_path / f"world-{world}"
        tmp.mkdir()
        output = tmp / "output"
        (output / "checkpoints").mkdir(parents=True)
        shutil.copytree(checkpoint, output / "checkpoints" / "step-5")
        shutil.copytree(source / "run", output / "run")
        proc, _ = tk.train(tmp, demo_dir, cache, stage=stage, steps=5, world=world, output=output)
        tk.assert_ok(proc, tmp, world=world)
        assert "resumed from" in proc.stdout + proc.stderr
        exported = load_file(output / "final" / UNET)
        for key, value in saved.items():
            assert torch.equal(exported[key], value), key
        checkpoint = output / "checkpoints" / "step-5"


def test_nvme_offload_resumes_both_ways_without_reading_stale_swap(
    tmp_path, demo_dir, cache, reference
):
    """ZeRO-3 on NVMe (steps 1-2) -> ZeRO-2 (step 3) -> ZeRO-3 on NVMe (step 4) -> the same
    (step 5), the NVMe runs starting with every swap file of the run before overwritten with
    garbage: the losses still follow the uninterrupted reference, so the optimizer state
    crossed over both ways and nothing was read from a stale swap file."""
    output, nvme_run, plain_run = tmp_path / "output", tmp_path / "nvme-run", tmp_path / "plain"
    nvme_run.mkdir()
    plain_run.mkdir()
    offload = {"offload_optimizer": "nvme", "offload_param": "nvme"}
    logs = []
    for steps, (tmp, extra) in enumerate(
        [(nvme_run, offload), (plain_run, {}), (nvme_run, offload), (nvme_run, offload)], start=2
    ):
        if tmp is nvme_run and steps > 2:
            stale = [p for p in (nvme_run / "nvme").rglob("*") if p.is_file()]
            assert stale, "the NVMe run left no swap files to poison"
            for path in stale:
                path.write_bytes(os.urandom(path.stat().st_size))
        proc, _ = tk.train(tmp, demo_dir, cache, stage=3 if extra else 2, steps=steps,
                           output=output, **extra)  # fmt: skip
        tk.assert_ok(proc, tmp)
        logs.append(proc.stdout + proc.stderr)
    # always converted: DeepSpeed's own NVMe load loses the LR and Adam's state
    _assert_follows(output, reference, demo_dir, logs, [False, True, True, True])


def test_a_conversion_failing_on_rank_0_stops_every_rank(chain, tmp_path, demo_dir, cache):
    """Rank 0 converts alone; when that fails (here a file stands where its temp folder goes)
    the other rank must not wait at a barrier: both stop at once, with rank 0's reason."""
    source, _ = chain
    output = tmp_path / "output"
    checkpoint = output / "checkpoints" / "step-5"
    shutil.copytree(source / "checkpoints" / "step-5", checkpoint)
    shutil.copytree(source / "run", output / "run")
    (checkpoint / ".universal.tmp").write_text("in the way")
    proc, _ = tk.train(tmp_path, demo_dir, cache, stage=3, steps=6, output=output)
    statuses = tk.statuses(tmp_path)
    assert proc.returncode != 0
    assert {rank: s["exit_code"] for rank, s in statuses.items()} == {0: 1, 1: 1}
    assert "rank 0 failed: NotADirectoryError" in statuses[1]["message"], statuses
    assert ".universal.tmp" in statuses[1]["message"]  # the reason, with the path
    assert verify(checkpoint) is None  # still committed and whole: a retry resumes it
