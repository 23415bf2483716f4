"""The machine a bench ran on, and the results as JSON and a markdown table (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GiB = 1 << 30


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    out = [
        f"# zerotuner bench {r['date']}",
        "",
        f"Machine: {m['cpu']} ({m.get('cpu_capability', 'ISA not recorded')}), {m['cores']} "
        f"cores, {m['ram_gib']} GiB RAM, no GPU "
        f"({m['accelerator']}); torch {m['torch']}, DeepSpeed {m['deepspeed']}, diffusers "
        f"{m['diffusers']}. Load average at start {r['load_start']}, at end {r['load_end']} "
        "(a shared machine: other jobs ran at the same time, so timings are noisy). "
        f"Model: SDXL-shaped UNet, {r['model']['unet_params'] / 1e6:.1f}M parameters, 64 px "
        "(16x16 latents), fp32, micro-batch 2 per rank. Wall time "
        f"{r['wall_seconds'] / 60:.1f} min"
        + (" (SMOKE: tiny sizes, numbers meaningless)." if r["smoke"] else "."),
        "",
    ]
    for rerun in r.get("reruns", []):
        out += [
            f"Re-run later ({rerun['started_utc']}"
            + (f", {rerun['cpu']}" if rerun.get("cpu") else "")
            + f", load {rerun['load_start']} -> {rerun['load_end']}): "
            f"{', '.join(rerun['suites'])}.",
            "",
        ]
    o = r.get("overhead")
    if o:
        pairs = o["pair_ratios"]
        a_med = o.get("zerotuner_run_medians_s")
        b_med = o.get("bare_run_medians_s")
        out += [
            "## Harness overhead (ZeRO-2, 2 ranks)", "",
            "| A/B pair | `zerotuner train` s/step | bare DeepSpeed loop s/step | ratio |",
            "|---|---|---|---|",
        ]  # fmt: skip
        for i, ratio in enumerate(pairs):
            a = "-" if a_med is None else f"{a_med[i]:.3f}"
            bb = "-" if b_med is None else f"{b_med[i]:.3f}"
            out.append(f"| {i + 1} | {a} | {bb} | {ratio:.3f} |")
        out += [
            f"| **median** | **{o['zerotuner_median_s']:.3f}** | **{o['bare_median_s']:.3f}** "
            f"| **{o['overhead_ratio']:.3f}** |",
            "",
            f"**overhead_ratio = {o['overhead_ratio']:.3f}** (target <= 1.03): the median of "
            f"the {len(pairs)} per-pair ratios (min {min(pairs):.3f}, max {max(pairs):.3f}); "
            "s/step per run is the median after skipping the first "
            f"{o['warmup_steps_skipped']} of {o['steps_per_run']} steps; order "
            f"{' '.join(o['order'])}. zerotuner's s/step is the interval between consecutive "
            "steps.jsonl timestamps (sinks and per-step checks included; its step_seconds field "
            f"alone: {o.get('zerotuner_median_step_seconds_field_s', float('nan')):.3f} s). "
            "The machine is shared (load average above), so single pairs move by +-15%.",
            "",
        ]  # fmt: skip
    prof = r.get("overhead_profile")
    if prof:
        out += [
            "Where the training loop's time goes (py-spy, all ranks, waits included; "
            "`python -m bench.profile`):",
            "",
            "| bucket | % of loop samples |",
            "|---|---|",
        ]
        for k, v in sorted(prof["percent"].items(), key=lambda kv: -kv[1]):
            out.append(f"| {k} | {v:.1f} |")
        out += [
            "",
            f"Harness share (everything but DeepSpeed forward/backward/step): "
            f"**{prof['harness_percent']:.1f}%** of {prof['samples_in_training_loop']} "
            "samples.",
            "",
        ]
    t = r.get("first_step")
    if t:
        out += [
            "## Time to first step (s)",
            "",
            "| phase | zerotuner (cold cache) | zerotuner (warm cache) |",
            "|---|---|---|",
        ]
        cold, warm = t["zerotuner_cold_cache"], t["zerotuner_warm_cache"]
        for k in cold["phases_s"]:
            out.append(f"| {k} | {cold['phases_s'][k]:.2f} | {warm['phases_s'][k]:.2f} |")
        out += [
            f"| **total** | **{cold['total_s']:.1f}** | **{warm['total_s']:.1f}** |",
            "",
            "| phase | bare loop |",
            "|---|---|",
        ]
        for k, v in t["bare"]["phases_s"].items():
            out.append(f"| {k} | {v:.2f} |")
        out += [f"| **total** | **{t['bare']['total_s']:.1f}** |", ""]
    p = r.get("planner")
    if p:
        out += [
            "## Planner accuracy (tensor bytes per rank, peak within a step)",
            "",
            "| ZeRO | optimizer | params | planned MB | measured peak MB (ranks) | error "
            "| peak in | end of backward MB | after the step MB | disk planned MB "
            "| disk measured MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in p["rows"]:
            if "error" in row:
                out.append(
                    f"| {row['zero_stage']} | {row['offload_optimizer']} | "
                    f"{row['offload_param']} | failed: {row['error']} | | | | | | | |"
                )
                continue
            peaks = row.get("measured_peak_bytes_per_rank") or row["measured_bytes_per_rank"]
            out.append(
                f"| {row['zero_stage']} | {row['offload_optimizer']} | {row['offload_param']} "
                f"| {_mb(row['predicted_bytes_per_rank'])} | "
                f"{' / '.join(_mb(x) for x in peaks)} | {row['error_percent']:+.1f}% | "
                f"{'/'.join(sorted(set(row.get('peak_phase', ['-']))))} | "
                + " / ".join(
                    _mb(x)
                    for x in row.get(
                        "measured_after_backward_bytes_per_rank",
                        row.get("measured_bytes_per_rank", []),
                    )
                )
                + " | "
                + " / ".join(_mb(x) for x in row.get("measured_after_step_bytes_per_rank", []))
                + f" | {_mb(row['predicted_disk_bytes_per_rank'])} | "
                f"{_mb(row['measured_disk_bytes_per_rank'])} |"
            )
        out += [
            "",
            "Planned: the plan row's parts that are tensors of the training step (params, "
            "grads, optimizer states, buckets, gathered params, swap buffers, activations). "
            "Measured peak: the most live tensor bytes on the rank after any op of step 2 "
            "(forward, backward, optimizer step), every storage tracked from allocation to "
            "free (`bench/peak.py`). Error = (planned - measured) / measured: + means the "
            "planner overestimates.",
            "",
        ]
        h = p.get("host")
        if h:
            procs = ", ".join(
                f"{x['command'].split()[-1] if x['command'] else '?'} {_mb(x['peak_rss_bytes'])}"
                for x in h["peak_rss_by_process"][:4]
            )
            out += [
                f"Host memory, {h['setup']}: planned **{h['planned_host_bytes'] / GiB:.2f} "
                f"GiB**, measured peak of the process tree's summed RSS "
                f"**{h['measured_peak_rss_sum_bytes'] / GiB:.2f} GiB** "
                f"({h['error_percent_vs_rss']:+.0f}%; summed PSS "
                f"{h['measured_peak_pss_sum_bytes'] / GiB:.2f} GiB). Peak RSS by process, MB: "
                f"{procs}.",
                "",
            ]
    if r.get("load_peak"):
        from bench.load_peak import table

        out += table(r["load_peak"])
    if r.get("load_peak_sdxl"):
        from bench.load_peak import table

        title = "## Load peak, SDXL-size UNet (2.57B, random weights; host RSS per rank)"
        out += table(r["load_peak_sdxl"], title)
    if r.get("speed"):
        from bench.speed import table as speed_table

        out += ["## Speed vs a plain loop", "", *speed_table(r["speed"]), ""]
    lv = r.get("lora_vs_full")
    if lv:
        out += lora_table(lv)
    n = r.get("nvme")
    if n:
        raw, d = n["raw_o_direct_dd"], n["training_default_aio"]
        out += [
            "## NVMe offload (ZeRO-3, optimizer + params on NVMe)",
            "",
            f"Disk {n['offload_disk']}: dd O_DIRECT 1 MiB sequential write "
            f"{_mb(raw['write_bytes_per_s'])} MB/s, read {_mb(raw['read_bytes_per_s'])} MB/s.",
            "",
            "| aio | s/step | read MB/step | written MB/step | read MB/s of training | "
            "write MB/s of training | MB/s while disk busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, run in (("defaults", d), ("recommended", n["training_recommended_aio"])):
            if run and "error" in run:
                out.append(f"| {label} {run['aio']} | failed: {run['error']} | | | | | |")
            elif run:
                out.append(
                    f"| {label} {run['aio']} | {run['median_step_s']:.2f} | "
                    f"{_mb(run['read_bytes_per_step'])} | {_mb(run['written_bytes_per_step'])} | "
                    f"{_mb(run['read_bytes_per_s_of_training'])} | "
                    f"{_mb(run['write_bytes_per_s_of_training'])} | "
                    f"{_mb(run['bytes_per_s_while_disk_busy'])} |"
                )
        out += [
            "",
            "DeepSpeed aio handle, one file (MB/s):",
            "",
            "| block | queue depth | intra-op | write | read |",
            "|---|---|---|---|---|",
        ]
        for row in n["aio_sweep"]:
            out.append(
                f"| {row['block_size'] // 1024} KiB | {row['queue_depth']} | "
                f"{row['intra_op_parallelism']} | {_mb(row['write_bytes_per_s'])} | "
                f"{_mb(row['read_bytes_per_s'])} |"
            )
        best = n["aio_recommended"]
        out += [
            "",
            f"Recommended aio: block_size {best['block_size']}, queue_depth "
            f"{best['queue_depth']}, intra_op_parallelism {best['intra_op_parallelism']} "
            f"(now {n['aio_defaults_now']}).",
            "",
        ]
    s = r.get("scaling")
    if s:
        out += [
            "## Scaling (bare loop, ZeRO-2)",
            "",
            f"1 rank: {s['samples_per_s_1_rank']:.2f} samples/s "
            f"({s['samples_per_s_1_rank_1_thread']:.2f} with 1 thread); 2 ranks: "
            f"{s['samples_per_s_2_ranks']:.2f} samples/s (x{s['speedup']:.2f}). {s['note']}.",
            "",
        ]
    st = r.get("stops")
    if st:
        out += [
            "## Stopping (SIGTERM at a random moment, ZeRO-2, 2 ranks)",
            "",
            f"**{st['survived']} of {st['trials']}** trials exited 143 with the last finished "
            f"step committed; {st['steps_lost']} steps lost in all. Signal to exit: median "
            f"{_s(st['signal_to_exit_median_s'])} s, max {_s(st['signal_to_exit_max_s'])} s "
            f"(a step takes {_s(st['median_step_s'])} s; the rest is the save, the commit and "
            "the ranks' exit).",
            "",
            "| signal after step (+ s) | exit | last step | committed | signal to exit s |",
            "|---|---|---|---|---|",
        ]
        for x in st["rows"]:
            out.append(
                f"| {x['signal_after_steps']} (+{x['signal_delay_s']:.2f}) | {x['exit_code']} "
                f"| {x['last_step']} | {x['committed_step']} | {_s(x['signal_to_exit_s'])} |"
            )
        out.append("")
    g = r.get("gpu_paper")
    if g:
        out += [
            "## The GPU picture on paper (ESTIMATE, not measured)",
            "",
            f"SDXL, 1024^2, batch 8, one 24 GB RTX 4090. zerotuner would choose "
            f"**{g['choice']['label']}**: {g['device_bytes'] / GiB:.1f} GiB on the GPU "
            f"(seed measured 13,102 MiB = 12.8 GiB with ZeRO-2 + CPU offload).",
            "",
            "| part of a step | estimated s |",
            "|---|---|",
        ]
        for k, v in g["step_parts_seconds"].items():
            out.append(f"| {k} | {v:.2f} |")
        out += [
            f"| **step** | **{g['step_seconds']:.1f}** (seed measured 8 s) |",
            "",
            f"Assumptions: {g['assumptions']['gpu_bf16_tflops']} bf16 TFLOPS at "
            f"{g['assumptions']['mfu']:.0%} utilisation, "
            f"{g['flops']['step'] / 1e12:.0f} TFLOP per step (counted on the meta device), "
            f"PCIe {g['assumptions']['pcie_bytes_per_s'] / 1e9:.0f} GB/s, CPU Adam as "
            f"measured here per core x {g['assumptions']['host_cores']} cores.",
            "",
        ]
        lo = g.get("lora")
        if lo:
            out += [
                f"The same job as LoRA (rank {lo['rank']}, {lo['targets']}: "
                f"{lo['trainable_params'] / 1e6:.1f}M trainable, the "
                f"{lo['frozen_params'] / 1e9:.2f}B-parameter base frozen in bf16): zerotuner "
                f"would choose **{lo['choice']['label']}**: "
                f"{lo['device_bytes'] / GiB:.1f} GiB on the GPU, "
                f"{lo['host_bytes'] / GiB:.1f} GiB host while training"
                + (
                    f" (load peak {lo['load_peak_host_bytes'] / GiB:.1f} GiB)"
                    if "load_peak_host_bytes" in lo
                    else ""
                )
                + f"; about **{lo['step_seconds']:.1f} s** "
                f"per step ({lo['flops']['step'] / 1e12:.0f} TFLOP: backward computes no "
                "weight gradients for the frozen base; no CPU Adam, no PCIe traffic).",
                "",
            ]
    if r.get("base_precision"):
        from bench.base_precision import markdown as base_precision_markdown

        out += base_precision_markdown(r["base_precision"])
    if r.get("base_precision_speed"):
        from bench.base_precision import speed_markdown as base_precision_speed_markdown

        out += base_precision_speed_markdown(r["base_precision_speed"])
    if r.get("optimizers"):
        from bench.optimizers import markdown as optimizers_markdown

        out += optimizers_markdown(r["optimizers"])
    if r.get("notify"):
        from bench.notify import markdown as notify_markdown

        out += notify_markdown(r["notify"])
    return "\n".join(out) + "\n"


def lora_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "## LoRA vs full (same model, data and stage; 2 ranks, fp32)",
        "",
        "| ZeRO | optimizer | training | trainable M | frozen M | s/step "
        "| peak MB per rank | planned MB | error | checkpoint MB | output MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = (
            f"| {row['zero_stage']} | {row['offload_optimizer']} | {row['training_type']} | "
            f"{row['trainable_params'] / 1e6:.2f} | {row['frozen_params'] / 1e6:.1f} |"
        )
        if "error" in row:
            out.append(f"{head} failed: {row['error']} | | | | | |")
            continue
        out.append(
            f"{head} {_s(row['step_s'])} | "
            f"{' / '.join(_mb(x) for x in row['measured_peak_bytes_per_rank'])} | "
            f"{_mb(row['predicted_bytes_per_rank'])} | {row['error_percent']:+.1f}% | "
            f"{_mb(row['checkpoint_bytes'])} | {_mb(row['output_bytes'])} |"
        )
    out += [
        "",
        "s/step: `zerotuner train`, median interval between steps.jsonl lines after the "
        "warm-up. Peak: the most live tensor bytes on each rank within step 2 of the bare "
        "DeepSpeed loop with the same config (`bench/peak.py`); planned: "
        "the plan row's tensor parts (the frozen base counted as weights only). Checkpoint: "
        "the end-of-run `checkpoints/step-N/`; output: `final/unet/` (full) or "
        "`final/pytorch_lora_weights.safetensors` (LoRA).",
        "",
    ]
    return out


def merged(new: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Today's results file with the suites in `new` replaced (their own machine/load noted)."""
    stem = new["date"] + ("-smoke" if new["smoke"] else "")
    path = folder / f"{stem}.json"
    if not path.exists():
        return new
    old = json.loads(path.read_text())
    suites = (
        "overhead", "first_step", "planner", "lora_vs_full", "nvme", "scaling", "stops",
        "gpu_paper", "load_peak", "load_peak_sdxl", "speed", "base_precision",
        "base_precision_speed", "optimizers", "notify",
    )  # fmt: skip
    for key in suites:
        if key in new:
            old[key] = new[key]
    old.setdefault("reruns", []).append(
        {"suites": [k for k in suites if k in new], "started_utc": new["started_utc"],
         "cpu": new["machine"]["cpu"],
         "load_start": new["load_start"], "load_end": new.get("load_end"),
         "wall_seconds": new.get("wall_seconds")}
    )  # fmt: skip
    return old


def write(results: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    stem = results["date"] + ("-smoke" if results["smoke"] else "")
    js = folder / f"{stem}.json"
    md = folder / f"{stem}.md"
    js.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md.write_text(markdown(results))
    return js, md
