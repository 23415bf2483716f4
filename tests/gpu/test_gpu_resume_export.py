"""Checkpoints move between the CPU and CUDA; SIGTERM stops with 143; export + generation.

All on the tiny demo (the session's `demo_dir`). Cross-device runs are fp32 on both sides
(DeepSpeed's CPU accelerator has no bf16 here), so only the device changes.
"""

from __future__ import annotations

import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.gpu

FIRST, SECOND = 3, 5  # steps before the checkpoint, and where the resumed run ends
LEGS = {"cpu-to-cuda": ("cpu", "cuda"), "cuda-to-cpu": ("cuda", "cpu")}


def _env(device, demo_dir, out, steps):
    from gpukit import cpu_env, cuda_env

    make = cuda_env if device == "cuda" else cpu_env
    return make(demo_dir, out, ZT_MAX_STEPS=str(steps), ZT_RESUME="auto",
                ZT_MIXED_PRECISION="no")  # fmt: skip


@pytest.fixture(scope="session")
def cross_device(tmp_path_factory, demo_dir):
    """Each leg: train FIRST steps on one device, then resume on the other to SECOND."""
    from gpukit import train

    work = tmp_path_factory.mktemp("cross-device")

    def leg(name, index):
        out = work / name
        return train(_env(LEGS[name][index], demo_dir, out, FIRST if index == 0 else SECOND))

    with ThreadPoolExecutor(max_workers=2) as pool:
        firsts = dict(zip(LEGS, pool.map(lambda n: leg(n, 0), LEGS), strict=True))
        seconds = dict(zip(LEGS, pool.map(lambda n: leg(n, 1), LEGS), strict=True))
    return {name: (firsts[name], seconds[name]) for name in LEGS}


@pytest.mark.parametrize("name", list(LEGS))
def test_checkpoint_resumes_on_the_other_device(check, cross_device, name):
    """A checkpoint resumes on the other device"""
    first, second = cross_device[name]
    for label, run in (("first", first), ("resumed", second)):
        if not check.expect(run.returncode == 0, f"{label} run exits 0 (got {run.returncode})"):
            check.set_error(run.tail())
            return
    latest = (second.output / "checkpoints" / "latest").read_text().strip()
    check.expect(
        latest.endswith(f"step-{SECOND}"), f"checkpoints/latest is step {SECOND} ({latest})"
    )
    steps = {s["step"]: s for s in second.steps()}
    check.expect(FIRST + 1 in steps, f"the resumed run trained step {FIRST + 1}")
    check.expect(1 not in steps or FIRST + 1 in steps, "steps continue after the checkpoint")
    losses = [s["loss"] for s in steps.values()]
    check.expect(all(math.isfinite(v) for v in losses), f"losses finite: {losses}")
    check.expect("resum" in second.log.lower(), "the log says it resumed")
    check.data["seconds"] = [round(first.seconds, 1), round(second.seconds, 1)]


@pytest.fixture(scope="session")
def stopped_run(tmp_path_factory, demo_dir):
    from gpukit import cuda_env, train

    out = tmp_path_factory.mktemp("sigterm")
    env = cuda_env(demo_dir, out, ZT_MAX_STEPS="100000")
    return train(env, stop_after_steps=3)


def test_sigterm_stops_with_143(check, stopped_run):
    """SIGTERM during GPU training exits 143 with the last step committed"""
    run = stopped_run
    check.expect(run.signalled_at_step is not None, "signalled after 3 steps")
    if not check.expect(run.returncode == 143, f"exit 143 (got {run.returncode})"):
        check.set_error(run.tail())
        return
    last = run.steps()[-1]["step"]
    pointer = run.output / "checkpoints" / "latest"
    committed = pointer.read_text().strip() if pointer.is_file() else ""
    check.expect(
        committed.endswith(f"step-{last}"), f"latest ({committed}) is the last step {last}"
    )
    check.expect("Traceback" not in run.log, "no traceback in the log")


def test_export_and_generation_on_the_gpu(check, stopped_run, tmp_path):
    """Export of a GPU checkpoint, and generation with it on the GPU"""
    run = stopped_run
    pointer = run.output / "checkpoints" / "latest"
    if not check.expect(pointer.is_file(), "the stopped run left a checkpoint"):
        return
    checkpoint = run.output / "checkpoints" / pointer.read_text().strip().split("/")[-1]
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "zerotuner", "export", str(checkpoint), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if not check.expect(done.returncode == 0, f"export exits 0 (got {done.returncode})"):
        check.set_error(done.stdout[-1000:] + done.stderr[-2000:])
        return
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(out, torch_dtype=torch.bfloat16).to("cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    image = pipe("a red circle on a white background", num_inference_steps=4, height=64,
                 width=64, generator=generator).images[0]  # fmt: skip
    pixels = np.asarray(image)
    check.expect(image.size == (64, 64), f"a 64x64 image ({image.size})")
    check.expect(pixels.std() > 0, f"the image is not constant (std {pixels.std():.2f})")
    check.expect(next(pipe.unet.parameters()).is_cuda, "the UNet ran on the GPU")
