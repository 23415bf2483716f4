"""Timing: s/step of an SDXL-shaped ~600M-parameter UNet, ZeRO-2 with and without CPU offload,
`zerotuner train` next to bench's bare `deepspeed.initialize` loop on the same GPU; and
zerotuner with its blocks eager and compiled (ZT_COMPILE) next to the plain loop a user writes
by hand (bench.plain_loop), which is what `ZT_COMPILE=auto` on CUDA waits for (issue 19).

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


@pytest.fixture(scope="module")
def plain_cuda(timing_model, tmp_path_factory):
    """The plain loop's run on the timing model (once for both stages), or its error."""
    from gpukit import run_plain_cuda

    try:
        return run_plain_cuda(tmp_path_factory.mktemp("plain"), timing_model, steps=STEPS,
                              resolution=RESOLUTION, batch=1)  # fmt: skip
    except RuntimeError as error:
        return str(error)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_compiled_blocks_vs_eager_and_plain_loop(
    check, timing_model, plain_cuda, tmp_path, zero_stage
):
    """s/step and time to first step: zerotuner eager and compiled vs the plain loop"""
    from gpukit import cuda_env, median, train

    plain = plain_cuda
    if isinstance(plain, str):
        check.expect(False, "the plain loop runs on the GPU")
        check.set_error(plain)
        return
    plain_s = median(plain["step_seconds"][WARMUP:])
    losses = {}
    for compiled in ("false", "true"):
        env = cuda_env(
            timing_model, tmp_path / f"compile-{compiled}", ZT_RESOLUTION=str(RESOLUTION),
            ZT_TRAIN_BATCH_SIZE="1", ZT_ZERO_STAGE=str(zero_stage), ZT_OFFLOAD_OPTIMIZER="none",
            ZT_OFFLOAD_PARAM="none", ZT_GRADIENT_CHECKPOINTING="false", ZT_MAX_STEPS=str(STEPS),
            ZT_COMPILE=compiled,
        )  # fmt: skip
        run = train(env)
        row = {"zero": zero_stage, "compile": compiled, "px": RESOLUTION, "batch": 1,
               "plain s/step": round(plain_s, 3),
               "plain first step s": round(plain["first_step_s"], 1)}  # fmt: skip
        if not check.expect(run.returncode == 0, f"train exits 0 (ZT_COMPILE={compiled})"):
            check.set_error(run.tail())
            check.table("compile", row)
            continue
        steps = run.steps()
        product = median(product_seconds(steps)[WARMUP - 1 :])
        graphs = [line.rsplit("speed: ", 1)[-1] for line in run.log.splitlines()
                  if "graphs compiled" in line]  # fmt: skip
        losses[compiled] = [s["loss"] for s in steps]
        row |= {"train s/step": round(product, 3), "speedup vs plain": round(plain_s / product, 2),
                "first step s": round(run.first_step_s() or float("nan"), 1),
                "graphs": graphs[-1] if graphs else "-"}  # fmt: skip
        check.table("compile", row)
    if len(losses) == 2:  # the same draws: compiled losses within bf16 rounding of eager ones
        worst = max(abs(a - b) / max(abs(b), 1e-6)
                    for a, b in zip(losses["true"], losses["false"], strict=True))  # fmt: skip
        check.expect(worst < 0.05, f"compiled losses match eager within {worst:.2%}")
