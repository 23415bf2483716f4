"""bf16 training at ZeRO 0-3, CPU and NVMe offload, the metrics endpoint, the planner table.

One session fixture trains bench's 95M-parameter SDXL-shaped UNet (gpumodels.write_medium_model)
in each configuration through `./entrypoint train` on one GPU, three runs at a time (each
process has its own torch.cuda counters); the checks below read those runs.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.gpu

STEPS = 4
CONFIGS = {  # id -> ZT_* overrides
    "zero0": {"ZT_ZERO_STAGE": "0"},
    "zero1": {"ZT_ZERO_STAGE": "1"},
    "zero2": {"ZT_ZERO_STAGE": "2"},
    "zero3": {"ZT_ZERO_STAGE": "3"},
    "zero2-optimizer-cpu": {"ZT_ZERO_STAGE": "2", "ZT_OFFLOAD_OPTIMIZER": "cpu"},
    "zero3-nvme": {
        "ZT_ZERO_STAGE": "3",
        "ZT_OFFLOAD_OPTIMIZER": "nvme",
        "ZT_OFFLOAD_PARAM": "nvme",
    },
}
PLAN_TOLERANCE = 0.25  # |planned - measured| / measured the table may show before it fails


@pytest.fixture(scope="session")
def medium_runs(tmp_path_factory):
    from gpukit import cuda_env, train
    from gpumodels import write_medium_model

    root = write_medium_model(tmp_path_factory.mktemp("medium"))
    work = tmp_path_factory.mktemp("medium-runs")

    def one(name):
        out = work / name
        pins = {"ZT_OFFLOAD_OPTIMIZER": "none", "ZT_OFFLOAD_PARAM": "none"} | CONFIGS[name]
        env = cuda_env(
            root, out, ZT_MAX_STEPS=str(STEPS), ZT_GRADIENT_CHECKPOINTING="false", **pins
        )
        return name, train(env)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(one, CONFIGS))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_training(check, medium_runs, name):
    """bf16 training on one GPU"""
    run = medium_runs[name]
    check.data["seconds"] = round(run.seconds, 1)
    if not check.expect(run.returncode == 0, f"train exits 0 (got {run.returncode})"):
        check.set_error(run.tail())
        return
    steps = run.steps()
    check.expect(len(steps) == STEPS, f"{STEPS} steps in steps.jsonl (got {len(steps)})")
    losses = [s["loss"] for s in steps]
    check.expect(all(math.isfinite(v) for v in losses), f"losses finite: {losses}")
    import json

    ds = json.loads((run.output / "run" / "deepspeed.json").read_text())
    zero = ds.get("zero_optimization", {})
    want = CONFIGS[name]
    check.expect(ds.get("bf16", {}).get("enabled") is True, "DeepSpeed config has bf16 enabled")
    check.expect(zero.get("stage") == int(want["ZT_ZERO_STAGE"]), f"ZeRO stage {zero.get('stage')}")
    for key in ("offload_optimizer", "offload_param"):
        device = zero.get(key, {}).get("device", "none")
        expected = want.get(f"ZT_{key.upper()}", "none")
        check.expect(device == expected, f"{key} is {device} (wanted {expected})")
    if "nvme" in name:
        swap = [p for p in (run.output.parent / "offload").rglob("*") if p.is_file()]
        check.data["swap files"] = len(swap)
    check.expect("Traceback" not in run.log, "no traceback in the log")


def test_metrics_endpoint_during_training(check, medium_runs):
    """The metrics endpoint's device-memory and NVML series are non-zero during a GPU run"""
    import torch
    from gpukit import metric, samples

    text = medium_runs["zero2"].metrics
    if not check.expect(text, "/metrics was read after a finished step"):
        return
    for name in ("allocated", "reserved", "peak", "total", "used"):
        value = metric(text, f"zerotuner_device_memory_{name}_bytes")
        check.data[name] = value
        check.expect(value and value > 0, f"zerotuner_device_memory_{name}_bytes > 0 ({value})")
    total = torch.cuda.get_device_properties(0).total_memory
    got = metric(text, "zerotuner_device_memory_total_bytes") or 0
    check.expect(abs(got - total) <= 0.03 * total, "total within 3% of torch.cuda's total_memory")
    used = metric(text, "zerotuner_device_memory_used_bytes") or 0
    reserved = metric(text, "zerotuner_device_memory_reserved_bytes") or 0
    check.expect(used >= reserved, "NVML's used >= the rank's reserved (the context adds to it)")
    peak = metric(text, "zerotuner_device_memory_peak_bytes") or 0
    allocated = metric(text, "zerotuner_device_memory_allocated_bytes") or 0
    check.expect(peak >= allocated, "peak >= allocated")
    labels = [lab for lab, _ in samples(text, "zerotuner_device_memory_used_bytes")]
    check.expect(all(lab.get("gpu_uuid", "").startswith("GPU-") for lab in labels), "gpu_uuid set")


def test_planner_against_max_memory_allocated(check, medium_runs):
    """The planner's device estimate against torch.cuda.max_memory_allocated()"""
    from gpukit import metric

    for name, run in medium_runs.items():
        row = run.chosen_row()
        peak = metric(run.metrics, "zerotuner_device_memory_peak_bytes") if run.metrics else None
        planned = row["device_bytes"] if row else None
        error = (planned - peak) / peak if planned and peak else None
        check.table("planned device bytes vs max_memory_allocated (MiB, per rank)", {
            "configuration": name, "plan row": row["label"] if row else "-",
            "planned": round(planned / 2**20) if planned else "-",
            "measured": round(peak / 2**20) if peak else "-",
            "error": f"{error:+.1%}" if error is not None else "-",
        })  # fmt: skip
        if check.expect(error is not None, f"{name}: plan and peak both read"):
            check.expect(
                abs(error) <= PLAN_TOLERANCE,
                f"{name}: plan within {PLAN_TOLERANCE:.0%} of the measured peak ({error:+.1%})",
            )
