"""A committed checkpoint resumes on another ZeRO stage and another number of ranks.

One uninterrupted ZeRO-2 run on 2 ranks is the reference. A chain of runs covers the same
steps, each resuming the previous one's checkpoint under another stage (2 -> 3 -> 0 -> 1 ->
2): with the same ranks the data and noise are the same, so the losses and final weights
match the reference only if weights, Adam moments, step count and LR schedule all carried
over. Then the checkpoint moves 2 ranks -> 1 -> 2 without training (max steps reached): the
export equals the checkpoint's weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

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


def test_stage_changes_resume_everything(chain, reference, demo_dir) -> None:
    output, logs = chain
    converted = ["converting once to universal/" in log for log in logs]
    assert converted == [False, True, True, True, False]  # ZeRO 1 -> 2: DeepSpeed's own load
    steps, expected = tk.read_steps(output), tk.read_steps(reference)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    for got, want in zip(steps, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (steps, expected)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-6)
    # Adam turns the rounding noise of ~zero gradients (biases before a GroupNorm) into
    # lr-sized steps, so a few weights differ between ZeRO layouts; on average the chain must
    # sit on the reference (lost Adam moments would differ by about a whole update)
    final, want = load_file(output / "final" / UNET), load_file(reference / "final" / UNET)
    base = load_file(demo_dir / "model" / UNET)
    drift = torch.cat([(final[k] - want[k]).abs().flatten() for k in want]).mean().item()
    update = torch.cat([(want[k] - base[k]).abs().flatten() for k in want]).mean().item()
    print(f"chain vs reference: mean weight difference {drift:.2e}, mean update {update:.2e}")
    assert drift < 1e-3 * update


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
