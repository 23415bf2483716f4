"""A LoRA base stored in 8 bits (ZT_BASE_PRECISION): the frozen base's host bytes measured at
each precision on the bench model's UNet, against the planner's count of the same row.

Each (run dtype, precision) in its own process (`python -m bench.base_precision MODEL DTYPE
PRECISION`), so that nothing another measurement allocated stays in it: its RSS after its
imports, then after the UNet loads at the run's dtype and is stored as a LoRA run stores it
(weights.base_precision.quantize_frozen_base; glibc's malloc_trim gives back what the
quantizer's temporaries left in the heap), and the difference is the base's host bytes (on a
GPU they are device bytes), anonymous and file-backed apart: an fp32 UNet loaded from
safetensors at fp32 keeps its weights in the file's mapped pages, and the pages of the layers
stored in 8 bits stay resident there (clean page cache the kernel may drop) while the mapping
lives. Beside it: the bytes of the module's tensors (torchao's 8-bit
values and scales), and the planner's frozen part of the row (make_plan on a CPU machine, the
UNet's config on the meta device).
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import runs

DTYPES = {"fp32": "no", "bf16": "bf16"}  # the run's dtype -> ZT_MIXED_PRECISION
PRECISIONS = ("auto", "fp8", "int8")
RSS = {"anon_bytes": "RssAnon", "file_bytes": "RssFile"}
LORA_RANK = 16


def rss() -> dict[str, int]:
    """This process's resident bytes: anonymous, and of mapped files."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap's freed pages back to the OS
    status = dict(x.split(":", 1) for x in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[name].split()[0]) * 1024 for k, name in RSS.items()}


def measure(model: Path, dtype: str, precision: str) -> dict[str, int]:
    """In this process: the UNet at `dtype` stored at `precision`, its bytes held."""
    import torch
    import torchao.quantization  # type: ignore[import-untyped]  # imported before the baseline
    from diffusers import UNet2DConditionModel

    from zerotuner.weights import base_precision

    del torchao
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    before = rss()
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", torch_dtype=torch_dtype)
    unet.requires_grad_(False)
    tensors = sum(t.numel() * t.element_size() for t in (*unet.parameters(), *unet.buffers()))
    if base_precision.is_low(precision):
        tensors = base_precision.quantize_frozen_base(unet, precision).after
    for t in (*unet.parameters(), *unet.buffers()):  # read each once, as a step would: a
        if type(t) in (torch.Tensor, torch.nn.Parameter):  # mapped file's pages become resident
            t.sum()
    after = rss()
    held = {k: after[k] - before[k] for k in RSS}
    return {"host_bytes": sum(held.values()), **held, "tensor_bytes": tensors}


def planned(model: Path, dtype: str, precision: str) -> dict[str, int]:
    """The planner's frozen base for this UNet (LoRA rank 16 on attention, ZeRO-2, 1 rank)."""
    from zerotuner.families import model_shape
    from zerotuner.machine.hardware import GiB, Hardware
    from zerotuner.preflight import trainable
    from zerotuner.preflight.plan import PlanRequest, make_plan
    from zerotuner.weights.lora import ATTENTION

    shape = model_shape("sdxl", model)
    training = trainable.lora_adapter(shape, rank=LORA_RANK, targets=ATTENTION, model_dir=model)
    request = PlanRequest(
        resolution=64, micro_batch=1, world_size=1, zero_stage=2, offload_optimizer="none",
        offload_param="none", gradient_checkpointing=False, mixed_precision=DTYPES[dtype],
        base_precision=precision,
    )  # fmt: skip
    hardware = Hardware("cpu", host_memory=64 * GiB, cpu_count=2)
    parts = make_plan(
        shape=shape, hardware=hardware, request=request, training=training, require_fit=False
    ).choice.parts
    return {
        "planned_bytes": parts["device.frozen_params"],  # the CPU's "device" is host memory
        "planned_upcast_bytes": parts.get("device.frozen_base_upcast", 0),
    }


def base_precision(b: Any) -> list[dict[str, Any]]:
    """The suite: one row per run dtype and precision."""
    rows = []
    for dtype in DTYPES:
        for precision in PRECISIONS:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.base_precision", str(b.model), dtype, precision],
                cwd=runs.REPO, env=runs.base_env(), capture_output=True, text=True,
                timeout=runs.TIMEOUT, check=True,
            )  # fmt: skip
            measured = json.loads(proc.stdout.strip().splitlines()[-1])
            row = {"dtype": dtype, "precision": precision, **measured}
            row |= planned(b.model, dtype, precision)
            row["measured_over_planned"] = row["host_bytes"] / row["planned_bytes"]
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's section (bench/report.py)."""
    out = [
        "## A LoRA base stored in 8 bits (ZT_BASE_PRECISION): host bytes of the frozen UNet",
        "",
        "| run dtype | base | measured MB: anon + file-backed | module's tensors MB | planned MB "
        "| measured / planned | planned upcast copy MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['dtype']} | {r['precision']} | {r['host_bytes'] / 1e6:.1f}: "
            f"{r['anon_bytes'] / 1e6:.1f} + {r['file_bytes'] / 1e6:.1f} | "
            f"{r['tensor_bytes'] / 1e6:.1f} | {r['planned_bytes'] / 1e6:.1f} | "
            f"{r['measured_over_planned']:.3f} | {r['planned_upcast_bytes'] / 1e6:.1f} |"
        )
    return [*out, "", " ".join(__doc__.split("\n\n")[1].split()), ""]


def speed(b: Any, rounds: int = 2) -> dict[str, Any]:
    """Step time of one LoRA run on a base stored at each precision, relative to the run's
    own precision: the bench UNet, ZeRO-2 on 2 CPU ranks in bf16, rounds interleaving the
    precisions; per round each one's median steady s/step over `auto`'s, and the medians of
    those ratios over rounds. On the CPU every stored layer upcasts its weight for each matmul
    (forward and backward) with no fp8 matmul to gain: the ratio is that cost."""
    from bench.suites import interleaved, intervals, median, steady

    def step_seconds(precision: str, i: int) -> float:
        work = b.work(f"base-precision-{precision}-{i}")
        env = runs.zt_env(work, b.model, b.data, steps=b.steps, zero_stage=2,
                          offload_optimizer="none", mixed_precision="bf16",
                          training_type="lora", lora_rank=LORA_RANK,
                          base_precision=precision)  # fmt: skip
        return median(steady(intervals(runs.run_product(work, env).steps), b.warmup))

    seconds, ratios = interleaved(PRECISIONS, rounds, step_seconds)
    return {
        "setup": f"the bench UNet, LoRA rank {LORA_RANK} on attention, ZeRO-2, 2 ranks, bf16, "
        "micro-batch 2",
        "rounds": rounds,
        "step_seconds": seconds,
        "step_time_vs_auto": {p: median(ratios[p]) for p in PRECISIONS},
        "step_time_vs_auto_rounds": ratios,
    }


def speed_markdown(r: dict[str, Any]) -> list[str]:
    """The report's section (bench/report.py)."""
    from bench.suites import ratio_rows

    out = [
        "## A LoRA base stored in 8 bits (ZT_BASE_PRECISION): step time on the CPU",
        "",
        f"{r['setup']}; {r['rounds']} interleaved rounds.",
        "",
        "| base | s/step (median) | vs auto (median of rounds) | rounds |",
        "|---|---:|---:|---|",
        *ratio_rows(PRECISIONS, r["step_seconds"], r["step_time_vs_auto_rounds"]),
    ]
    return [*out, "", " ".join(speed.__doc__.split("\n\n")[0].split()), ""]  # type: ignore[union-attr]


if __name__ == "__main__":
    model, dtype, precision = sys.argv[1:4]
    print(json.dumps(measure(Path(model), dtype, precision)))
