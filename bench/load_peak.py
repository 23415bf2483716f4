"""load_peak: peak host RSS per rank from process start until the DeepSpeed engine is ready.

Today's path ("full_copy"): every rank builds the whole UNet in fp32 before
`deepspeed.initialize` partitions it. Measured with the bare loop (bench.bare, no step: its
RSS high-water mark when the engine is ready) at ZeRO-3 with the optimizer and the parameters
on NVMe, so no optimizer state sits in host memory to hide the load under, on a ~380M-parameter
UNet at world 1 and 2 on the CPU; next to each row, the planner's load-phase figure per rank.
The bare loop loads no VAE or text encoders, so the planner's "load" phase (rank runtime and
the fp32 UNet) is what compares, not its "caching" phase.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench import runs
from bench.benchmodel import write_bench_model
from bench.suites import Bench, preflight_for

LOAD_BLOCKS = (256, 512, 1024)  # ~380M UNet parameters: the issue asks for >= 300M
OFFLOAD = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
# DeepSpeed's default sub_group_size (1e9 elements) makes the whole model one optimizer
# sub-group, and initializing it holds its fp32 partition, gradient and both Adam moments in
# memory at once (measured: 10 GB for this 380M model at world 1), hiding the load. Small
# sub-groups keep that transient to ~5 x 4 bytes x 1e7.
SUB_GROUP = 10_000_000


def load_peak(b: Bench) -> list[dict[str, Any]]:
    """One row per world size (1 and 2; --smoke: world 1 on the small bench UNet)."""
    paths = write_bench_model(
        b.root / "load-model", small=b.smoke, blocks=None if b.smoke else LOAD_BLOCKS
    )
    lb = replace(b, model=paths.model, data=paths.data)
    rows = []
    for world in (1,) if b.smoke else (1, 2):
        pre, _ = preflight_for(lb, num_processes=world, **OFFLOAD)
        choice, load = pre.plan.choice, pre.plan.load
        name = f"load-peak-w{world}"
        config = pre.normalized.config
        config["zero_optimization"]["sub_group_size"] = SUB_GROUP
        try:
            run = runs.run_bare(b.work(name), paths.model, config, steps=0, world=world)
        except RuntimeError as error:  # keep the other rows; say what failed
            rows.append({"path": "full_copy", "world_size": world, "error": str(error)})
            continue
        peaks = [r["engine_ready_peak_rss_bytes"] for r in run.ranks]
        planned = load.per_rank_bytes("load")
        rows.append(row(world, pre.shape.unet_params, choice, peaks, planned) | {
            "planned_load_parts_per_rank": {
                k: load.per_rank[k] for k in load.phase_parts("load")},
            "planned_load_host_bytes_per_node": load.phase_bytes("load"),
            "planned_load_peak_host_bytes_per_node": load.peak_bytes,
            # what the engine adds on the host before it is ready (swap buffers ...): the
            # row's host tensors per rank, on top of the load
            "planned_engine_host_parts_per_rank": {
                k: v for k, v in choice.parts.items()
                if k.startswith("host_per_rank.") and k != "host_per_rank.process"},
            "sub_group_size": SUB_GROUP,
            "engine_ready_seconds": run.rank0["times"]["engine_ready"]
            - run.rank0["times"]["process_start"],
        })  # fmt: skip
    return rows


def row(world: int, params: int, choice: Any, peaks: list[int], planned: int) -> dict[str, Any]:
    """The issue's row, `{"path", "world_size", "params", "offload", "peak_rss_bytes"}`, with
    the planner's per-rank load figure beside it."""
    offload = f"optimizer->{choice.offload_optimizer}, params->{choice.offload_param}"
    peak = max(peaks)
    return {
        "path": "full_copy",
        "world_size": world,
        "params": params,
        "offload": offload,
        "zero_stage": choice.zero_stage,
        "peak_rss_bytes": peak,
        "peak_rss_bytes_per_rank": peaks,
        "planned_load_bytes_per_rank": planned,
        "error_percent": 100 * (planned - peak) / peak,
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The results page's section."""
    mb = 2**20
    out = [
        "## Load peak (host RSS per rank until the engine is ready)",
        "",
        "Bare loop, no step; ZeRO-3 with the optimizer and parameters on NVMe, CPU, fp32. "
        "`full_copy`: every rank builds the whole fp32 UNet before `deepspeed.initialize`. "
        "Planned: the plan's load phase per rank (rank runtime + the fp32 UNet).",
        "",
        "| path | world | params | offload | peak RSS per rank MB | planned MB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['path']} | {r['world_size']} | failed: {r['error']} |||||")
            continue
        ranks = " / ".join(f"{p / mb:.0f}" for p in r["peak_rss_bytes_per_rank"])
        out.append(
            f"| {r['path']} | {r['world_size']} | {r['params'] / 1e6:.0f}M | {r['offload']} | "
            f"{ranks} | {r['planned_load_bytes_per_rank'] / mb:.0f} | "
            f"{r['error_percent']:+.1f} % |"
        )
    return [*out, ""]
