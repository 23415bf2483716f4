"""load_peak: peak host RSS per rank from process start until the DeepSpeed engine is ready.

Two paths at ZeRO-3 with the optimizer and the parameters on NVMe (so no optimizer state sits
in host memory to hide the load under), on a ~380M-parameter UNet, at world 1 and 2 on the CPU:
"full_copy" (every rank builds the whole fp32 UNet, `deepspeed.initialize` partitions it;
ZT_ZERO_INIT=false) and "zero_init" (built inside `deepspeed.zero.Init`, weights streamed in:
zerotuner/zero_init.py). The ranks run zerotuner's own `train.model.load_denoiser` and then
`deepspeed.initialize` with the config zerotuner's preflight produced (`python -m
bench.load_peak`, under torchrun); no VAE or text encoders load, so the planner's "load" phase
(runtime and the trained model) is what compares, not its "caching" phase. Each path loads the
UNet saved in fp32 and in fp16: diffusers memory-maps an fp32 file and uses its pages as the
weights (file-backed, shared by the ranks of a node in the page cache, counted in each rank's
RSS once read), while fp16 weights cast to fp32 are memory of each rank's own. Beside each row,
the planner's load figure per rank for that path and the issue's goal.

`load_peak_sdxl` (`python -m bench --only load_peak_sdxl`): the same two paths on the SDXL-size
UNet (the published config in zerotuner's families registry, 2.57B parameters, random weights
saved once in fp32), world 2 only, where the full copy is the whole point: each rank's fp32 UNet
is ~10 GB. Run it under a memory bound (a cgroup); a rank killed there is its row's result, with
the highest RSS each rank was seen at (the sampler writes it as it goes).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

STARTED = time.time()

LOAD_BLOCKS = (256, 512, 1024)  # ~380M UNet parameters: the issue asks for >= 300M
OFFLOAD = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
PATHS = ("full_copy", "zero_init")
SDXL_TIMEOUT = 3600  # the SDXL-size engine writes ~41 GB of parameters and Adam states to NVMe


def load_peak(b: Any) -> list[dict[str, Any]]:
    """One row per path and world size (1 and 2; --smoke: world 1 on the small bench UNet)."""
    from bench.benchmodel import write_bench_model
    from bench.suites import preflight_for

    paths = write_bench_model(
        b.root / "load-model", small=b.smoke, blocks=None if b.smoke else LOAD_BLOCKS
    )
    lb = replace(b, model=paths.model, data=paths.data)
    models = {"fp32": paths.model, "fp16": fp16_copy(paths.model, b.root / "load-model-fp16")}
    rows = []
    for world in (1,) if b.smoke else (1, 2):
        pre, _ = preflight_for(lb, num_processes=world, **OFFLOAD)
        config = pre.normalized.config  # as zerotuner runs it (sub_group_size: the planner's)
        for weights, model in models.items():
            for path in PATHS:
                name = f"load-peak-{path}-{weights}-w{world}"
                try:
                    ranks = run_ranks(b.work(name), model, config, world=world, path=path)
                except RuntimeError as error:  # keep the other rows; say what failed
                    rows.append({"path": path, "world_size": world, "weights": weights,
                                 "error": str(error)})  # fmt: skip
                    continue
                rows.append(row(path, world, pre, ranks) | {"weights": weights})
    return rows


def load_peak_sdxl(b: Any) -> list[dict[str, Any]]:
    """The SDXL-size UNet at world 2, fp32 file, both paths (--smoke: the small UNet, world 1)."""
    from bench.suites import preflight_for

    paths = write_sdxl_unet_model(b.root / "load-model-sdxl", smoke=b.smoke)
    lb = replace(b, model=paths.model, data=paths.data)
    world = 1 if b.smoke else 2
    # The training plan does not fit this host (its host and disk rows: `unfit`); the load is
    # what is measured, with the config zerotuner produces for the closest option.
    pre, _ = preflight_for(lb, num_processes=world, require_fit=False, **OFFLOAD)
    config = pre.normalized.config
    swap = Path(config["zero_optimization"]["offload_param"]["nvme_path"])
    rows = []
    for path in PATHS:
        shutil.rmtree(swap, ignore_errors=True)  # a killed path's swap files: ~41 GB
        swap.mkdir(parents=True, exist_ok=True)
        name = f"load-peak-sdxl-{path}-fp32-w{world}"
        try:
            ranks = run_ranks(
                b.work(name), paths.model, config, world=world, path=path, timeout=SDXL_TIMEOUT
            )
        except RuntimeError as error:  # killed by the memory bound: what each rank was seen at
            rows.append(failed_row(path, world, pre, b.work(name), error) | {"model": "sdxl"})
            continue
        rows.append(row(path, world, pre, ranks) | {"weights": "fp32", "model": "sdxl"})
    shutil.rmtree(swap, ignore_errors=True)
    unfit = list(pre.plan.reasons) if pre.plan.choice.short else []
    return [r | {"plan_unfit": unfit} for r in rows]


def write_sdxl_unet_model(dir: Path, *, smoke: bool = False) -> Any:
    """The bench pipeline with its UNet replaced by SDXL's (families.REGISTRY["sdxl"]'s published
    config, random weights, one fp32 safetensors file; --smoke: the bench's small UNet)."""
    import torch
    from diffusers import UNet2DConditionModel

    from bench.benchmodel import write_bench_model
    from zerotuner.families import REGISTRY

    paths = write_bench_model(dir, small=True)
    if smoke:
        return paths
    torch.manual_seed(12)
    unet = UNet2DConditionModel(**REGISTRY["sdxl"].builtin_config)
    unet.save_pretrained(paths.model / "unet", safe_serialization=True, max_shard_size="64GB")
    del unet
    return paths


def failed_row(path: str, world: int, pre: Any, work: Path, error: Exception) -> dict[str, Any]:
    """A path whose ranks did not get the engine ready: the error, and the highest RSS each
    rank's sampler last wrote (a rank the memory bound killed stops there)."""
    seen = []
    for r in range(world):
        f = work / f"rank-{r}.progress.json"
        seen.append(json.loads(f.read_text()) if f.exists() else None)
    log = (work / "ranks.log").read_text() if (work / "ranks.log").exists() else ""
    killed = "SIGKILL" in log or "Signal 9" in log
    load = planned(pre, path, world)
    engine, goal = engine_goal(pre, world)
    return {
        "path": path,
        "world_size": world,
        "weights": "fp32",
        "params": pre.shape.denoiser_params,
        "planned_load_bytes_per_rank": load.per_rank_bytes(),
        "planned_load_parts_per_rank": dict(load.per_rank),
        "planned_engine_parts_per_rank": engine,
        "goal_bytes": goal,
        "error": ("killed (SIGKILL: the memory bound) " if killed else "") + str(error),
        "seen_peak_rss_bytes_per_rank": [s and s["peak_rss_bytes"] for s in seen],
        "loaded_peak_rss_bytes_per_rank": [s and s.get("loaded_peak_rss_bytes") for s in seen],
        "seen_peak_anon_bytes_per_rank": [s and s["peak_anon_bytes"] for s in seen],
        "seen_peak_file_bytes_per_rank": [s and s["peak_file_bytes"] for s in seen],
        "seen_phase_per_rank": [s and s["phase"] for s in seen],
        "seen_seconds_per_rank": [s and s["seconds"] for s in seen],
    }


def fp16_copy(model: Path, out: Path) -> Path:
    """The pipeline with its UNet's weights saved in fp16, as many published fine-tunes are:
    the full-copy path casts them to fp32 in memory of its own (not the file's pages)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out, dirs_exist_ok=True)
    weights = out / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({k: v.half() for k, v in load_file(weights).items()}, weights)
    return out


def planned(pre: Any, path: str, world: int) -> Any:
    """The planner's load peak for this path (zero_init: the ZeRO-3 row's)."""
    from zerotuner.preflight.memory import load_peak as plan_load

    choice = pre.plan.choice
    return plan_load(
        pre.shape, ranks_per_node=world, precision=pre.plan.inputs.precision, on_cpu=True,
        zero_stage=choice.zero_stage if path == "zero_init" else None,
        offload_param=choice.offload_param, world_size=world,
    )  # fmt: skip


def engine_goal(pre: Any, world: int) -> tuple[dict[str, int], int]:
    """The plan row's engine parts per rank (host parts and, on the CPU, its device buckets)
    and the issue's goal: params / world in the training dtype + one largest tensor + those
    buffers + the rank runtime."""
    from zerotuner.preflight.memory import RANK_PROCESS

    choice, shape = pre.plan.choice, pre.shape
    p_bytes = 4 if pre.plan.inputs.precision == "no" else 2
    engine = {k.split(".", 1)[1]: v for k, v in choice.parts.items()
              if k.startswith("host_per_rank.") or k == "device.buckets"}  # fmt: skip
    buffers = sum(v for k, v in engine.items() if k != "process")
    goal = (shape.denoiser_params // world + shape.largest_param) * p_bytes + buffers + RANK_PROCESS
    return engine, goal


def row(path: str, world: int, pre: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's row, `{"path", "world_size", "params", "offload", "peak_rss_bytes"}`, with
    the planner's figures per rank beside it: the load phase of this path, and what the engine
    holds once ready (the plan row's host parts, and on the CPU its device buckets: the CPU
    accelerator's device memory is this process's). `goal_bytes`: the issue's target, params /
    world in the training dtype + one largest tensor + those buffers + the rank runtime."""
    choice, shape = pre.plan.choice, pre.shape
    load = planned(pre, path, world)
    engine, goal = engine_goal(pre, world)
    peaks = [r["engine_ready_peak_rss_bytes"] for r in ranks]
    peak = max(peaks)
    return {
        "path": path,
        "world_size": world,
        "params": shape.denoiser_params,
        "offload": f"optimizer->{choice.offload_optimizer}, params->{choice.offload_param}",
        "zero_stage": choice.zero_stage,
        "peak_rss_bytes": peak,
        "peak_rss_bytes_per_rank": peaks,
        "loaded_peak_rss_bytes_per_rank": [r["loaded_peak_rss_bytes"] for r in ranks],
        "peak_anon_bytes_per_rank": [r["peak_anon_bytes"] for r in ranks],
        "peak_file_bytes_per_rank": [r["peak_file_bytes"] for r in ranks],
        "planned_load_bytes_per_rank": load.per_rank_bytes(),
        "planned_load_parts_per_rank": dict(load.per_rank),
        "planned_engine_parts_per_rank": engine,
        "goal_bytes": goal,
        "goal_ratio": peak / goal,
        "sub_group_size": pre.normalized.config["zero_optimization"].get("sub_group_size"),
        "engine_ready_seconds": ranks[0]["engine_ready"] - ranks[0]["process_start"],
    }


def run_ranks(
    work: Path, model: Path, config: dict, *, world: int, path: str, timeout: int | None = None
) -> list[dict]:
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
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout or TIMEOUT)  # fmt: skip
    (work / "ranks.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"ranks exited {done.returncode}; log in {work}/ranks.log")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(world)]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler(threading.Thread):
    """The highest anonymous and file-backed resident bytes seen (/proc/self/status, every
    20 ms): a memory-mapped safetensors file counts in RSS once read, as file pages the ranks
    of a node share in the page cache, where a copy in memory of its own is anonymous."""

    def __init__(self, out: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.anon = self.file = 0
        self.out, self.phase, self.loaded = out, "start", None

    def run(self) -> None:
        last = 0.0
        while True:
            text = Path("/proc/self/status").read_text()
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            self.anon = max(self.anon, int(fields["RssAnon"].split()[0]) * 1024)
            self.file = max(self.file, int(fields["RssFile"].split()[0]) * 1024)
            if self.out is not None and time.time() - last > 1:  # what a killed rank leaves
                last = time.time()
                self.progress()
            time.sleep(0.02)

    def progress(self) -> None:
        assert self.out is not None
        record = {"peak_rss_bytes": peak_rss(), "peak_anon_bytes": self.anon,
                  "peak_file_bytes": self.file, "phase": self.phase,
                  "loaded_peak_rss_bytes": self.loaded,
                  "seconds": time.time() - STARTED}  # fmt: skip
        f = self.out / f"rank-{os.environ.get('RANK', '0')}.progress.json"
        f.with_suffix(".tmp").write_text(json.dumps(record))
        f.with_suffix(".tmp").replace(f)


def rank_main(model: Path, config_file: Path, out: Path) -> None:
    """One rank: zerotuner's load_denoiser (the path ZT_ZERO_INIT picks), then the engine."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from zerotuner.train.model import load_denoiser

    sampler = Sampler(out)
    sampler.start()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    config = json.loads(config_file.read_text())
    times = {"process_start": STARTED, "imported": time.time()}
    sampler.phase = "load_denoiser"
    unet = load_denoiser(model, gradient_checkpointing=True, deepspeed_config=config)
    times["loaded"] = time.time()
    loaded = peak_rss()
    sampler.phase, sampler.loaded = "deepspeed.initialize", loaded
    sampler.progress()  # a rank killed in the engine still says what its load peaked at
    deepspeed.initialize(model=unet, model_parameters=list(unet.parameters()), config=config)
    times["engine_ready"] = time.time()
    time.sleep(0.05)  # one more sample
    record = {
        "loaded_peak_rss_bytes": loaded,
        "engine_ready_peak_rss_bytes": peak_rss(),
        "peak_anon_bytes": sampler.anon,
        "peak_file_bytes": sampler.file,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(record | times))
    dist.barrier()


def table(
    rows: list[dict[str, Any]],
    title: str = "## Load peak (host RSS per rank until the engine is ready)",
) -> list[str]:
    """The results page's section."""
    mb = 2**20

    def ranks(values: list[int]) -> str:
        return " / ".join(f"{v / mb:.0f}" for v in values)

    out = [
        title,
        "",
        "ZeRO-3 with the optimizer and parameters on NVMe, CPU, fp32, the config zerotuner "
        "produces; zerotuner's load_denoiser, then deepspeed.initialize, no step. `full_copy`: "
        "every rank builds the whole fp32 UNet first; `zero_init`: built inside "
        "deepspeed.zero.Init, weights streamed in. Weights: the UNet file's dtype (fp16 files are "
        "cast to fp32). Loaded: the RSS peak after load_denoiser; "
        "planned load: the plan's load phase per rank for that path. Engine ready: the RSS "
        "peak until the engine is ready (its anonymous and file-backed peaks). Goal: params / "
        "world x 4 B + one largest tensor + the plan's host buffers + the rank runtime.",
        "",
        "| path | weights | world | params | loaded MB | planned load MB | engine ready MB "
        "| anon ; file MB | goal MB | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and "seen_peak_rss_bytes_per_rank" in r:
            seen = [v or 0 for v in r["seen_peak_rss_bytes_per_rank"]]
            loaded = [v or 0 for v in r.get("loaded_peak_rss_bytes_per_rank", [])]
            anon = [v or 0 for v in r["seen_peak_anon_bytes_per_rank"]]
            file = [v or 0 for v in r["seen_peak_file_bytes_per_rank"]]
            killed = "killed" if r["error"].startswith("killed") else "failed"
            out.append(
                f"| {r['path']} | {r.get('weights', 'fp32')} | {r['world_size']} "
                f"| {r['params'] / 1e6:.0f}M | {ranks(loaded) if loaded else '?'} "
                f"| {r['planned_load_bytes_per_rank'] / mb:.0f} "
                f"| {killed} in {' / '.join(map(str, r['seen_phase_per_rank']))}, last seen at "
                f"{ranks(seen)} | {ranks(anon)} ; {ranks(file)} "
                f"| {r['goal_bytes'] / mb:.0f} | - |"
            )
            continue
        if "error" in r:
            out.append(
                f"| {r['path']} | {r.get('weights', 'fp32')} | {r['world_size']} "
                f"| failed: {r['error']} |||||||"
            )
            continue
        out.append(
            f"| {r['path']} | {r.get('weights', 'fp32')} | {r['world_size']} "
            f"| {r['params'] / 1e6:.0f}M "
            f"| {ranks(r['loaded_peak_rss_bytes_per_rank'])} "
            f"| {r['planned_load_bytes_per_rank'] / mb:.0f} "
            f"| {ranks(r['peak_rss_bytes_per_rank'])} "
            f"| {ranks(r['peak_anon_bytes_per_rank'])} ; {ranks(r['peak_file_bytes_per_rank'])} "
            f"| {r['goal_bytes'] / mb:.0f} | {r['goal_ratio']:.2f} |"
        )
    return [*out, ""]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
