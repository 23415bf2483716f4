"""DeepSpeed's CUDA ops load, and the metrics' device-memory series agree with torch.cuda."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")  # GPU Adam, CPU offload, NVMe
AGREE = 0.03  # "within a few percent"


def test_cuda_ops_load(check):
    """DeepSpeed's fused Adam, CPU Adam and async I/O ops load on the CUDA accelerator."""
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    code = f"import sys; from zerotuner.machine.ops import build; sys.exit(build({OPS!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540
    )
    lines = {line.split(":", 1)[0]: line for line in done.stdout.splitlines() if ":" in line}
    for op in OPS:
        line = lines.get(op, f"{op}: no answer")
        check.expect(line.startswith(f"{op}: ready"), line)
    if done.returncode != 0:
        check.set_error(done.stdout[-1000:] + done.stderr[-2000:])


def test_metrics_probe_agrees_with_torch_cuda(check):
    """The metrics' device-memory and NVML series agree with torch.cuda."""
    import torch
    from gpukit import metric, samples
    from prometheus_client import CollectorRegistry, generate_latest

    from zerotuner.monitor.metrics import PrometheusSink

    registry = CollectorRegistry()
    sink = PrometheusSink(0, device="cuda:0", world_size=1, registry=registry)
    block = torch.ones(2**28, device="cuda")  # 1 GiB, so the counters are far from zero
    torch.cuda.synchronize()
    sink.sample_memory()
    text = generate_latest(registry).decode()
    free, total = torch.cuda.mem_get_info(0)
    expected = {
        "allocated": torch.cuda.memory_allocated(0),
        "reserved": torch.cuda.memory_reserved(0),
        "peak": torch.cuda.max_memory_allocated(0),
        "total": torch.cuda.get_device_properties(0).total_memory,
        "used": total - free,  # the driver's view, as NVML's
    }
    for name, want in expected.items():
        got = metric(text, f"zerotuner_device_memory_{name}_bytes")
        check.table("metric vs torch.cuda (GiB)", {
            "series": name, "metric": None if got is None else round(got / 2**30, 3),
            "torch.cuda": round(want / 2**30, 3),
        })  # fmt: skip
        check.expect(got is not None and got > 0, f"zerotuner_device_memory_{name}_bytes > 0")
        if got:
            off = abs(got - want) / want
            check.expect(
                off <= AGREE, f"{name}: metric within {AGREE:.0%} of torch.cuda ({off:.1%})"
            )
    uuid = {
        labels.get("gpu_uuid") for labels, _ in samples(text, "zerotuner_device_memory_used_bytes")
    }
    check.expect(
        any(u and u.startswith("GPU-") for u in uuid), f"gpu_uuid label is NVML's ({uuid})"
    )
    del block
