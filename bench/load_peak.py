"""load_peak: peak host RSS per rank from process start until the DeepSpeed engine is ready.

Two paths at ZeRO-3 with the optimizer and the parameters on NVMe (so no optimizer state sits
in host memory to hide the load under), on a ~380M-parameter UNet, at world 1 and 2 on the CPU:
"full_copy" (every rank builds the whole fp32 UNet, `deepspeed.initialize` partitions it;
ZT_ZERO_INIT=false) and "zero_init" (built inside `deepspeed.zero.Init`, weights streamed in:
zerotuner/zero_init.py). The ranks run zerotuner's own `model.load_unet` and then
`deepspeed.initialize` with the config zerotuner's preflight produced (`python -m
bench.load_peak`, under torchrun); no VAE or text encoders load, so the planner's "load" phase
(runtime and the trained model) is what compares, not its "caching" phase. Next to each row,
the planner's load figure per rank for that path.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

STARTED = time.time()

LOAD_BLOCKS = (256, 512, 1024)  # ~380M UNet parameters: the issue asks for >= 300M
OFFLOAD = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
# Initializing the NVMe optimizer holds one sub-group's fp32 partition, gradient and both Adam
# moments at once: at the config's 1e8 (plan_memory.SUB_GROUP_NVME) that is 1.6 GB, at the end
# of the window measured here, on top of the load. Small sub-groups keep it to ~5 x 4 B x 1e7,
# so what this measures is the load.
SUB_GROUP = 10_000_000
PATHS = ("full_copy", "zero_init")


def load_peak(b: Any) -> list[dict[str, Any]]:
    """One row per path and world size (1 and 2; --smoke: world 1 on the small bench UNet)."""
    from bench.benchmodel import write_bench_model
    from bench.suites import preflight_for

    paths = write_bench_model(
        b.root / "load-model", small=b.smoke, blocks=None if b.smoke else LOAD_BLOCKS
    )
    lb = replace(b, model=paths.model, data=paths.data)
    rows = []
    for world in (1,) if b.smoke else (1, 2):
        pre, _ = preflight_for(lb, num_processes=world, **OFFLOAD)
        config = pre.normalized.config
        config["zero_optimization"]["sub_group_size"] = SUB_GROUP
        for path in PATHS:
            try:
                ranks = run_ranks(b.work(f"load-peak-{path}-w{world}"), paths.model, config,
                                  world=world, path=path)  # fmt: skip
            except RuntimeError as error:  # keep the other rows; say what failed
                rows.append({"path": path, "world_size": world, "error": str(error)})
                continue
            rows.append(row(path, world, pre, ranks))
    return rows


def planned(pre: Any, path: str, world: int) -> Any:
    """The planner's load peak for this path (zero_init: the ZeRO-3 row's)."""
    from zerotuner.plan_memory import load_peak as plan_load

    choice = pre.plan.choice
    return plan_load(
        pre.shape, ranks_per_node=world, precision=pre.plan.inputs["precision"], on_cpu=True,
        zero_stage=choice.zero_stage if path == "zero_init" else None,
        offload_param=choice.offload_param, world_size=world,
    )  # fmt: skip


def row(path: str, world: int, pre: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's row, `{"path", "world_size", "params", "offload", "peak_rss_bytes"}`, with
    the planner's per-rank load figure beside it."""
    choice = pre.plan.choice
    load = planned(pre, path, world)
    peaks = [r["engine_ready_peak_rss_bytes"] for r in ranks]
    peak, plan = max(peaks), load.per_rank_bytes("load")
    return {
        "path": path,
        "world_size": world,
        "params": pre.shape.unet_params,
        "offload": f"optimizer->{choice.offload_optimizer}, params->{choice.offload_param}",
        "zero_stage": choice.zero_stage,
        "peak_rss_bytes": peak,
        "peak_rss_bytes_per_rank": peaks,
        "loaded_peak_rss_bytes_per_rank": [r["loaded_peak_rss_bytes"] for r in ranks],
        "planned_load_bytes_per_rank": plan,
        "planned_load_parts_per_rank": {k: load.per_rank[k] for k in load.phase_parts("load")},
        "error_percent": 100 * (plan - peak) / peak,
        "sub_group_size": SUB_GROUP,
        "engine_ready_seconds": ranks[0]["engine_ready"] - ranks[0]["process_start"],
    }


def run_ranks(work: Path, model: Path, config: dict, *, world: int, path: str) -> list[dict]:
    """`python -m bench.load_peak` under torchrun: `world` CPU ranks, one JSON each."""
    from bench.runs import REPO, TIMEOUT, base_env, free_port

    work.mkdir(parents=True, exist_ok=True)
    (work / "deepspeed.json").write_text(json.dumps(config, indent=2))
    env = base_env() | {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
        "ZT_ZERO_INIT": "true" if path == "zero_init" else "false",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
        f"--master_port={free_port()}", "-m", "bench.load_peak", str(model),
        str(work / "deepspeed.json"), str(work),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    (work / "ranks.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"ranks exited {done.returncode}; log in {work}/ranks.log")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(world)]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(model: Path, config_file: Path, out: Path) -> None:
    """One rank: zerotuner's load_unet (the path ZT_ZERO_INIT picks), then the engine."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from zerotuner.model import load_unet

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    config = json.loads(config_file.read_text())
    times = {"process_start": STARTED, "imported": time.time()}
    unet = load_unet(model, gradient_checkpointing=True, deepspeed_config=config)
    times["loaded"] = time.time()
    loaded = peak_rss()
    deepspeed.initialize(model=unet, model_parameters=list(unet.parameters()), config=config)
    times["engine_ready"] = time.time()
    record = {"loaded_peak_rss_bytes": loaded, "engine_ready_peak_rss_bytes": peak_rss()}
    (out / f"rank-{rank}.json").write_text(json.dumps(record | times))
    dist.barrier()


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The results page's section."""
    mb = 2**20
    out = [
        "## Load peak (host RSS per rank until the engine is ready)",
        "",
        "ZeRO-3 with the optimizer and parameters on NVMe, CPU, fp32; zerotuner's load_unet, "
        "then deepspeed.initialize, no step. `full_copy`: every rank builds the whole fp32 "
        "UNet first; `zero_init`: built inside deepspeed.zero.Init, weights streamed in. "
        "Planned: the plan's load phase per rank for that path.",
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


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
