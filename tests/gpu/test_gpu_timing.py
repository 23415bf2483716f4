"""Timing: s/step of an SDXL-shaped ~600M-parameter UNet, ZeRO-2 with and without CPU offload,
`zerotuner train` next to bench's bare `deepspeed.initialize` loop on the same GPU.

As bench/ does on the CPU: the same model, micro-batch and DeepSpeed config (the product's
run/deepspeed.json) for both; the median s/step after WARMUP steps; ratio = product / bare.
Nothing asserts a time: the check fails only when a run fails.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

RESOLUTION = 1024
STEPS, WARMUP = 8, 3


@pytest.fixture(scope="session")
def timing_model(tmp_path_factory):
    from gpumodels import write_timing_model

    return write_timing_model(tmp_path_factory.mktemp("timing"))


def product_seconds(steps: list[dict]) -> list[float]:
    """The product's s/step: intervals between consecutive steps.jsonl timestamps (as bench)."""
    stamps = [s["timestamp"] for s in steps]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_step_time_against_the_bare_loop(check, timing_model, tmp_path, offload):
    """s/step, zerotuner train vs the bare deepspeed.initialize loop (ZeRO-2)"""
    from gpukit import cuda_env, gib, median, metric, run_bare_cuda, train
    from gpumodels import parameters_on_meta, timing_unet_config

    env = cuda_env(
        timing_model, tmp_path, ZT_RESOLUTION=str(RESOLUTION), ZT_TRAIN_BATCH_SIZE="1",
        ZT_ZERO_STAGE="2", ZT_OFFLOAD_OPTIMIZER=offload, ZT_OFFLOAD_PARAM="none",
        ZT_GRADIENT_CHECKPOINTING="false", ZT_MAX_STEPS=str(STEPS),
    )  # fmt: skip
    run = train(env)
    row = {"offload": offload, "px": RESOLUTION, "batch": 1,
           "params (M)": round(parameters_on_meta(timing_unet_config()) / 1e6)}  # fmt: skip
    if not check.expect(run.returncode == 0, f"train exits 0 (got {run.returncode})"):
        check.set_error(run.tail())
        check.table("s/step", row)
        return
    product = median(product_seconds(run.steps())[WARMUP - 1 :])
    row |= {"train s/step": round(product, 3),
            "peak GiB": gib(metric(run.metrics, "zerotuner_device_memory_peak_bytes")),
            "planned GiB": gib((run.chosen_row() or {}).get("device_bytes"))}  # fmt: skip
    config = json.loads((run.output / "run" / "deepspeed.json").read_text())
    try:
        bare = run_bare_cuda(tmp_path / "bare", timing_model / "model", config, steps=STEPS,
                             resolution=RESOLUTION)  # fmt: skip
    except RuntimeError as error:
        check.expect(False, "the bare loop runs on the GPU")
        check.set_error(str(error))
        check.table("s/step", row)
        return
    bare_s = median(bare["step_seconds"][WARMUP:])
    row |= {"bare s/step": round(bare_s, 3), "ratio": round(product / bare_s, 3)}
    check.table("s/step", row)
    check.expect(True, f"train {product:.3f} s/step, bare {bare_s:.3f} s/step")
