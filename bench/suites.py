"""The measurements. Each returns a plain dict for the results JSON."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import disk, runs

NOT_TENSORS = {  # plan parts that are not tensors of the training step in a rank's memory
    "device.caching_peak", "device.framework", "host_per_rank.process",
    "host_per_rank.cuda_host_context",
    "host_per_rank.ema_once_per_node",
}  # fmt: skip


def tensor_parts(parts: dict[str, int]) -> dict[str, int]:
    """The plan parts a rank holds as tensors while it trains (device and host: on the CPU
    accelerator both are this process's memory); disk parts and fixed overheads left out."""
    return {k: v for k, v in parts.items() if not k.startswith("disk_") and k not in NOT_TENSORS}


@dataclass
class Bench:
    """Where a bench run keeps its files and how big it is."""

    root: Path  # scratch: model, runs, offload files (on the disk being measured)
    model: Path
    data: Path
    steps: int  # optimizer steps per timed run
    warmup: int  # steps skipped before "steady state"
    pairs: int  # A B pairs in the overhead comparison
    disk_mib: int
    smoke: bool = False

    def work(self, name: str) -> Path:
        return self.root / "runs" / name


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def steady(seconds: list[float], warmup: int) -> list[float]:
    return seconds[warmup:] if len(seconds) > warmup else seconds[-1:]


def intervals(steps: list[dict]) -> list[float]:
    """Seconds from one step's end to the next's (steps.jsonl timestamps): unlike the
    step_seconds field, this includes the sinks and after_step (stop check, EMA, ...) work.
    The first entry is step 1's own step_seconds."""
    if not steps:
        return []
    ts = [x["timestamp"] for x in steps]
    return [steps[0]["step_seconds"], *(b - a for a, b in zip(ts, ts[1:], strict=False))]


def interleaved(
    variants: Sequence[str], rounds: int, step_seconds: Callable[[str, int], float]
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """`step_seconds(variant, round)` for every variant in every round, the variants taking
    turns, so load that drifts over the run weighs on all alike: each variant's median over
    rounds, and per round its s/step over the first variant's (the baseline)."""
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(rounds):
        this_round = {v: step_seconds(v, i) for v in variants}
        for v in variants:
            seconds[v].append(this_round[v])
            ratios[v].append(this_round[v] / this_round[variants[0]])
    return {v: median(seconds[v]) for v in variants}, ratios


def ratio_rows(
    variants: Sequence[str], seconds: dict[str, float], ratios: dict[str, list[float]],
    extra: Callable[[str], str] | None = None,
) -> list[str]:  # fmt: skip
    """A report's rows for `interleaved`'s answer: s/step, the median ratio and each round's
    (`extra`: a cell of the suite's own after the variant's name)."""
    rows = []
    for v in variants:
        rounds = ", ".join(f"{x:.3f}" for x in ratios[v])
        cell = f" {extra(v)} |" if extra else ""
        rows.append(f"| {v} |{cell} {seconds[v]:.3f} | {median(ratios[v]):.3f} | {rounds} |")
    return rows


# --- effective configs and plans from zerotuner's own preflight --------------------------------


def preflight_for(
    b: Bench, *, require_fit: bool = True, **settings: Any
) -> tuple[Any, dict[str, float]]:
    """zerotuner's preflight in this process with the bench's ZT_* (timed: settings, probe,
    plan), exactly as `zerotuner train` calls it (`require_fit=False`: as `zerotuner config`
    does, the closest option's config where nothing fits this host)."""
    from zerotuner.machine.probe import probe
    from zerotuner.preflight.steps import preflight
    from zerotuner.settings.effective import effective_settings

    env = runs.zt_env(b.work("preflight"), b.model, b.data, steps=b.steps, **settings)
    Path(env["ZT_OFFLOAD_DIR"]).mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")} | env
    t0 = time.perf_counter()
    effective = effective_settings(environ)
    t1 = time.perf_counter()
    hardware = probe(effective.settings.device)
    t2 = time.perf_counter()
    pre = preflight(effective, hardware=hardware, require_fit=require_fit)
    t3 = time.perf_counter()
    return pre, {"settings": t1 - t0, "probe": t2 - t1, "plan": t3 - t2}


# --- harness overhead and time to first step ---------------------------------------------------


def overhead(b: Bench) -> dict[str, Any]:
    """zerotuner train (A) vs the bare loop (B), interleaved A B A B, ZeRO-2 on 2 ranks.

    Each A/B pair gives one ratio (A's median steady s/step / B's); overhead_ratio is the
    median of those pair ratios, so a pair run while the shared machine was busy moves one
    ratio instead of skewing pooled steps of all runs."""
    a_runs, b_runs, pair_wall = [], [], []
    config: dict | None = None
    for i in range(b.pairs):
        t0 = time.perf_counter()
        env = runs.zt_env(b.work(f"overhead-a{i}"), b.model, b.data, steps=b.steps,
                          zero_stage=2, offload_optimizer="none")  # fmt: skip
        a = runs.run_product(b.work(f"overhead-a{i}"), env)
        config = config or a.deepspeed
        a_runs.append(a)
        b_runs.append(runs.run_bare(b.work(f"overhead-b{i}"), b.model, config, steps=b.steps))
        pair_wall.append(time.perf_counter() - t0)
    a_medians = [median(steady(intervals(r.steps), b.warmup)) for r in a_runs]
    a_inside = [median(steady([x["step_seconds"] for x in r.steps], b.warmup)) for r in a_runs]
    b_medians = [median(steady(r.rank0["step_seconds"], b.warmup)) for r in b_runs]
    pairs = [a / bb for a, bb in zip(a_medians, b_medians, strict=True)]
    return {
        "setup": "ZeRO-2, 2 ranks, fp32, micro-batch 2, no offload, same DeepSpeed config",
        "steps_per_run": b.steps,
        "warmup_steps_skipped": b.warmup,
        "order": [f"{x}{i}" for i in range(b.pairs) for x in "AB"],
        "zerotuner_step_seconds": [[x["step_seconds"] for x in r.steps] for r in a_runs],
        "zerotuner_step_intervals": [intervals(r.steps) for r in a_runs],
        "bare_step_seconds": [r.rank0["step_seconds"] for r in b_runs],
        "zerotuner_run_medians_s": a_medians,
        "bare_run_medians_s": b_medians,
        "zerotuner_median_s": median(a_medians),  # median of the per-run medians
        "bare_median_s": median(b_medians),
        "zerotuner_median_step_seconds_field_s": median(a_inside),
        "pair_ratios": pairs,
        "overhead_ratio": median(pairs),
        "pair_ratio_min": min(pairs),
        "pair_ratio_max": max(pairs),
        "ratio_method": "per interleaved pair: zerotuner's median steady s/step / the bare "
        "loop's; overhead_ratio = median of the pair ratios",
        "pair_wall_s": pair_wall,
        "deepspeed_config": config,
        "_runs": (a_runs, b_runs),
    }


def first_step(b: Bench, over: dict[str, Any], split: dict[str, float]) -> dict[str, Any]:
    """Entrypoint start -> first finished step, by phase; the first run (cold feature cache)
    and the last (warm), next to the bare loop's."""
    a_runs, b_runs = over.pop("_runs")

    def product(r: runs.ProductRun) -> dict[str, float]:
        m, step1 = r.marks, r.steps[0]
        step1_start = step1["timestamp"] - step1["step_seconds"]
        entry = m["planned"] - r.spawned
        phases = {
            "interpreter+imports": entry - sum(split.values()),
            "settings": split["settings"],
            "probe": split["probe"],
            "plan (preflight: model shape, plan, normalize)": split["plan"],
            "job file + offload dir": m["launching"] - m["planned"],
            # the ranks start before the plan: what is left of their start-up after the job
            "ranks' start-up left (imports overlap the plan; process group)": m["loading"]
            - m["launching"],
            "model load": m["caching"] - m["loading"],
            "cache (latents + text embeddings)": m["cached"] - m["caching"],
            "engine init (deepspeed.initialize, resume check)": step1_start - m["cached"],
            "first step": step1["step_seconds"],
        }
        return {"total_s": step1["timestamp"] - r.spawned, "phases_s": phases}

    def bare(r: runs.BareRun) -> dict[str, float]:
        t = r.rank0["times"]
        phases = {
            "launch (torchrun)": t["process_start"] - r.spawned,
            "imports": t["imported"] - t["process_start"],
            "process group": t["distributed"] - t["imported"],
            "model load": t["model_loaded"] - t["distributed"],
            "engine init (deepspeed.initialize)": t["engine_ready"] - t["model_loaded"],
            "first step": t["first_step"] - t["engine_ready"],
        }
        return {"total_s": t["first_step"] - r.spawned, "phases_s": phases}

    return {
        "zerotuner_cold_cache": product(a_runs[0]),
        "zerotuner_warm_cache": product(a_runs[-1]),
        "bare": bare(b_runs[0]),
        "note": "settings/probe/plan timed in the bench process with the same ZT_* "
        "(same functions); the rest from the run's log timestamps and steps.jsonl",
        "_bare": b_runs[-1],
    }


# --- planner accuracy ---------------------------------------------------------------------------

COMBOS = (  # (stage, offload_optimizer, offload_param)
    (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
    (2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"),
)  # fmt: skip


def planner(b: Bench, stage2_bare: runs.BareRun | None) -> dict[str, Any]:
    """Predicted (the chosen plan row's tensor parts) vs the measured peak of live tensor
    bytes per rank within a step (bench.peak), and swap file bytes for NVMe; same config as
    zerotuner would use."""
    rows = []
    for stage, opt, param in COMBOS if not b.smoke else COMBOS[2:3]:
        pre, _ = preflight_for(b, zero_stage=stage, offload_optimizer=opt, offload_param=param)
        row = pre.plan.choice
        config = pre.normalized.config
        name = f"z{stage}-{opt}-{param}"
        if (stage, opt, param) == (2, "none", "none") and stage2_bare is not None:
            run = stage2_bare
        else:
            try:
                run = runs.run_bare(b.work(f"planner-{name}"), b.model, config, steps=2)
            except RuntimeError as error:  # keep the other rows; say what failed
                rows.append({"zero_stage": stage, "offload_optimizer": opt,
                             "offload_param": param, "error": str(error)})  # fmt: skip
                continue
        parts = tensor_parts(row.parts)
        predicted = sum(parts.values())
        peaks = [r["memory"]["peak_bytes"] for r in run.ranks]
        disk_pred = sum(v for k, v in row.parts.items() if k.startswith("disk_per_rank."))
        disk_meas = run.rank0["offload_files_bytes"]
        rows.append({
            "zero_stage": stage, "offload_optimizer": opt, "offload_param": param,
            "predicted_bytes_per_rank": predicted,
            "measured_peak_bytes_per_rank": peaks,
            "error_percent": 100 * (predicted - max(peaks)) / max(peaks),
            "peak_phase": [r["memory"]["peak_phase"] for r in run.ranks],
            "measured_step_start_bytes_per_rank": [
                r["memory"]["step_start_bytes"] for r in run.ranks],
            "measured_after_backward_bytes_per_rank": [
                r["memory"]["after_backward_bytes"] for r in run.ranks],
            "measured_after_step_bytes_per_rank": [r["memory"]["tensor_bytes"] for r in run.ranks],
            "predicted_parts": parts,
            "predicted_disk_bytes_per_rank": disk_pred or None,
            "measured_disk_bytes_per_rank": None if disk_meas is None
            else disk_meas / run.rank0["world_size"],
            "rss_bytes_per_rank": [r["memory"]["rss_bytes"] for r in run.ranks],
            "peak_rss_bytes_per_rank": [r.get("peak_rss_bytes") for r in run.ranks],
        })  # fmt: skip
    return {
        "host": None if b.smoke else host_memory(b),
        "what": "tensor bytes per rank: the plan row's parts that are tensors of the training "
        "step (params, grads, optimizer, buckets, gathered params, swap buffers, activations; "
        "not the fixed process overheads) vs the peak of live tensor bytes on each rank within "
        "step 2 (forward, backward and optimizer step), tracked op by op (bench.peak); bare "
        "loop, same config; CPU accelerator, so 'device' = host",
        "rows": rows,
    }


def host_memory(b: Bench) -> dict[str, Any]:
    """The plan's host bytes for the tiny demo (`zerotuner demo`, ZeRO-2, 2 CPU ranks) vs the
    peak memory of `zerotuner train`'s whole process tree while it trains: what the fixed
    per-process overheads of the plan come down to when the model is small."""
    from dataclasses import replace

    from zerotuner.demo.pipelines import write_demo

    paths = write_demo(b.root / "tiny", seed=0, family="sdxl")
    tiny = replace(b, model=paths.model, data=paths.data)
    settings = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none"}
    pre, _ = preflight_for(tiny, **settings)
    work = b.work("host-tiny-demo")
    env = runs.zt_env(work, paths.model, paths.data, steps=6, **settings)
    run = runs.run_product(work, env, monitor_memory=True)
    mem = run.memory
    assert mem is not None
    fixed = {k: v for k, v in pre.plan.choice.parts.items() if k in NOT_TENSORS}
    return {
        "setup": "tiny demo UNet, ZeRO-2, 2 CPU ranks, fp32, micro-batch 2, 6 steps",
        "planned_host_bytes": pre.plan.choice.host_bytes,
        "planned_fixed_parts": fixed,
        "measured_peak_rss_sum_bytes": mem.peak_rss,
        "measured_peak_pss_sum_bytes": mem.peak_pss,
        "error_percent_vs_rss": 100 * (pre.plan.choice.host_bytes - mem.peak_rss) / mem.peak_rss,
        "peak_rss_by_process": sorted(
            ({"command": c, "peak_rss_bytes": r} for c, r in mem.per_process.values()),
            key=lambda x: -x["peak_rss_bytes"],
        )[:6],
        "note": "RSS sums count shared library pages in every process that maps them (the safe "
        "side); "
        "PSS splits them between the processes sharing them",
    }


# --- NVMe offload -------------------------------------------------------------------------------


def nvme(b: Bench) -> dict[str, Any]:
    """ZeRO-3 with optimizer and params on NVMe: swap bytes and rates while training vs dd,
    DeepSpeed's aio handle swept over the aio settings, then a run with the best ones."""
    from zerotuner.preflight.deepspeed_config import AIO_DEFAULTS

    offload_root = b.root / "runs"
    offload_root.mkdir(parents=True, exist_ok=True)
    raw = disk.dd_throughput(offload_root / "dd", b.disk_mib)
    grid = disk.GRID if not b.smoke else {k: v[:1] for k, v in disk.GRID.items()}
    sweep = disk.aio_sweep(offload_root / "aio", min(b.disk_mib, 256), grid)
    best = disk.best_aio(sweep)
    device = runs.disk_of(offload_root)

    def train(name: str, aio: dict | None) -> dict[str, Any]:
        settings = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
        if aio:
            import json

            settings["deepspeed_config"] = json.dumps({"aio": aio})
        # SIGTERM after the last timed step: the final export at ZeRO-3 with the optimizer on
        # NVMe swaps the whole optimizer partition in once per tensor (minutes; docs/benchmarks.md).
        env = runs.zt_env(b.work(name), b.model, b.data, steps=b.steps + 50, **settings)
        r = runs.run_product(b.work(name), env, disk=device, monitor_io=True, stop_after=b.steps)
        r.steps = r.steps[: b.steps]
        steps = r.steps[b.warmup :] if len(r.steps) > b.warmup + 1 else r.steps[-1:]
        start = steps[0]["timestamp"] - steps[0]["step_seconds"]
        end = steps[-1]["timestamp"]
        read, written = r.io.between(start, end)
        busy = r.io.busy_seconds(start, end)
        seconds = end - start
        return {
            "aio": r.deepspeed.get("aio"),
            "step_seconds": [x["step_seconds"] for x in r.steps],
            "median_step_s": median([x["step_seconds"] for x in steps]),
            "window_s": seconds,
            "read_bytes_per_step": read / len(steps),
            "written_bytes_per_step": written / len(steps),
            "read_bytes_per_s_of_training": read / seconds,
            "write_bytes_per_s_of_training": written / seconds,
            "disk_busy_s": busy,
            "bytes_per_s_while_disk_busy": (read + written) / busy if busy else None,
        }

    default_run = train("nvme-default", None)
    tuned_aio = {k: best[k] for k in disk.GRID}
    same = all(AIO_DEFAULTS[k] == v for k, v in tuned_aio.items())
    tuned_run = None
    if not (same or b.smoke):
        try:
            tuned_run = train("nvme-tuned", tuned_aio)
        except RuntimeError as error:
            tuned_run = {"error": str(error), "aio": tuned_aio}
    aio_default_row = next(
        (r for r in sweep if all(r[k] == AIO_DEFAULTS[k] for k in disk.GRID)), None
    )
    return {
        "offload_disk": device,
        "raw_o_direct_dd": raw,
        "aio_sweep": sweep,
        "aio_defaults_now": {k: AIO_DEFAULTS[k] for k in disk.GRID},
        "aio_default_in_sweep": aio_default_row,
        "aio_recommended": best,
        "training_default_aio": default_run,
        "training_recommended_aio": tuned_run,
        "ratio_training_read_to_dd": default_run["read_bytes_per_s_of_training"]
        / raw["read_bytes_per_s"],
        "ratio_training_write_to_dd": default_run["write_bytes_per_s_of_training"]
        / raw["write_bytes_per_s"],
        "ratio_aio_default_to_dd": None if aio_default_row is None else {
            "read": aio_default_row["read_bytes_per_s"] / raw["read_bytes_per_s"],
            "write": aio_default_row["write_bytes_per_s"] / raw["write_bytes_per_s"],
        },
    }  # fmt: skip


# --- scaling ------------------------------------------------------------------------------------


def scaling(b: Bench, config: dict, two: runs.BareRun) -> dict[str, Any]:
    """Samples/s of the bare loop on 1 rank (all cores) vs 2 ranks (one core each), ZeRO-2."""
    cores = os.cpu_count() or 1
    one = runs.run_bare(b.work("scaling-1"), b.model, config, steps=b.steps, world=1)
    one_1t = runs.run_bare(
        b.work("scaling-1-1t"), b.model, config, steps=b.steps, world=1, threads=1
    )

    def rate(r: runs.BareRun) -> float:
        return r.rank0["samples_per_step"] / median(steady(r.rank0["step_seconds"], b.warmup))

    return {
        "micro_batch_per_rank": config["train_micro_batch_size_per_gpu"],
        "samples_per_s_1_rank": rate(one),
        "samples_per_s_1_rank_1_thread": rate(one_1t),
        "samples_per_s_2_ranks": rate(two),
        "speedup": rate(two) / rate(one),
        "speedup_vs_1_thread": rate(two) / rate(one_1t),
        "step_seconds_1_rank": one.rank0["step_seconds"],
        "step_seconds_1_rank_1_thread": one_1t.rank0["step_seconds"],
        "note": f"{cores} cores: 1 rank runs {cores} threads (zerotuner's rule: cores // ranks), "
        "2 ranks 1 thread each; the gradient all-reduce goes through gloo on the same cores",
    }


# --- stops --------------------------------------------------------------------------------------


def stops(b: Bench, trials: int) -> dict[str, Any]:
    """SIGTERM at a random moment of a ZeRO-2 run on 2 ranks (after 2-4 steps, plus 0-3 s):
    does it exit 143 with the last finished step committed, and how long from the signal to
    the exit (the budget ZT_STOP_GRACE_SECONDS and Kubernetes' grace period must cover)."""
    rng = random.Random(0)
    rows = []
    for trial in range(trials):
        work = b.work(f"stop-{trial}")
        env = runs.zt_env(work, b.model, b.data, steps=10_000, zero_stage=2)
        env["ZT_STOP_GRACE_SECONDS"] = "120"  # a stop that hangs ends as a failed trial
        after, delay = rng.randint(2, 4), round(rng.uniform(0, 3), 2)
        r = runs.run_product(work, env, stop_after=after, stop_delay=delay, check=False)
        pointer = Path(env["ZT_OUTPUT_DIR"]) / "checkpoints" / "latest"
        committed = int(pointer.read_text().rsplit("-", 1)[1]) if pointer.exists() else None
        last = r.steps[-1]["step"] if r.steps else 0
        rows.append({
            "signal_after_steps": after,
            "signal_delay_s": delay,
            "exit_code": r.code,
            "last_step": last,
            "committed_step": committed,
            "steps_lost": None if committed is None else last - committed,
            "signal_to_exit_s": None if r.signalled is None else r.ended - r.signalled,
            "median_step_s": median([x["step_seconds"] for x in r.steps]),
        })  # fmt: skip
    survived = [x for x in rows if x["exit_code"] == runs.EXIT_SIGNAL and x["steps_lost"] == 0]
    exits = [x["signal_to_exit_s"] for x in survived]
    return {
        "trials": trials,
        "survived": len(survived),
        "steps_lost": sum(x["steps_lost"] or 0 for x in rows),
        "signal_to_exit_median_s": median(exits),
        "signal_to_exit_max_s": max(exits, default=float("nan")),
        "median_step_s": median([x["median_step_s"] for x in rows]),
        "rows": rows,
    }
