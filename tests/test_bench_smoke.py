"""The bench harness must not rot: its parsers against real inputs, and one smoke run.

No timing assertions: benchmarks measure, tests only check that the harness still runs end
to end against the product (log lines, steps.jsonl, deepspeed.json) and reports every part.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

from bench import disk, runs  # noqa: E402
from bench.bare import held_tensor_bytes  # noqa: E402
from bench.peak import PeakTracker  # noqa: E402


def test_held_tensor_bytes_counts_each_storage_once():
    before = held_tensor_bytes()
    block = torch.zeros(1_000_000, dtype=torch.float32)
    views = [block[:10], block.view(1000, 1000)]  # share the storage: no extra bytes
    grown = held_tensor_bytes() - before
    assert 4_000_000 <= grown < 4_100_000
    del block, views


def test_peak_tracker_sees_what_lives_only_inside_a_step():
    """The in-step peak counts a temporary freed before the step ends and the activations
    autograd saves and frees in backward; a snapshot after backward sees neither."""
    with PeakTracker() as p:
        p.phase = "step"
        scratch = torch.empty(5_000_000)  # 20 MB, freed at once
        del scratch
    assert p.live == p.start and p.peak - p.start == 20_000_000 and p.peak_phase == "step"

    layer = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB of weights
    x = torch.randn(2000, 1000)  # 8 MB
    with PeakTracker() as q:
        q.phase = "forward"
        loss = layer(layer(x).relu()).square().mean()  # saves two 8 MB activations
        q.phase = "backward"
        loss.backward()
        del loss
    assert q.live - q.start == 4_000_000  # only the weight's grad is left
    assert q.peak - q.start >= 2 * 8_000_000 + 4_000_000
    assert q.peak_phase in ("forward", "backward")


def test_log_marks_read_the_products_timestamps():
    log = (
        "2026-11-22 10:39:46,668 INFO zerotuner.train: plan:\n"
        "  ZeRO-2 ...\n"
        "2026-11-22 10:39:46,674 INFO zerotuner.train: launching 2 rank(s) on node 0 of 1\n"
        "2026-11-22 10:39:56,267 INFO [rank 0] zerotuner.progress: phase: loading\n"
        "2026-11-22 10:39:58,569 INFO [rank 0] zerotuner.progress: phase: caching\n"
        "2026-11-22 10:39:59,471 INFO [rank 0] zerotuner.train.worker: cache: 64 latents encoded\n"
        "2026-11-22 10:40:59,000 INFO [rank 0] zerotuner.progress: phase: loading\n"
    )
    marks = runs.log_marks(log)
    assert set(marks) == {"planned", "launching", "loading", "caching", "cached"}
    assert round(marks["loading"] - marks["planned"], 3) == 9.599  # the first "loading"


def test_best_aio_weighs_read_and_write():
    rows = [
        {"block_size": 1, "queue_depth": 8, "intra_op_parallelism": 1,
         "read_bytes_per_s": 10.0, "write_bytes_per_s": 1.0},
        {"block_size": 2, "queue_depth": 8, "intra_op_parallelism": 1,
         "read_bytes_per_s": 4.0, "write_bytes_per_s": 4.0},
    ]  # fmt: skip
    assert disk.best_aio(rows)["block_size"] == 2


@pytest.mark.slow
def test_smoke_run_writes_results_and_table(tmp_path):
    """`python -m bench --smoke`: zerotuner train and the bare loop once each on a tiny UNet,
    the planner row for ZeRO-2, the LoRA row at ZeRO-2, one SIGTERM trial, then the JSON and
    the markdown table."""
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "overhead", "planner", "stops",
         "lora_vs_full",
         "--out", str(out), "--scratch", str(tmp_path / "scratch")],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (js,) = out.glob("*-smoke.json")
    results = json.loads(js.read_text())
    assert math.isfinite(results["overhead"]["overhead_ratio"])
    for side in ("zerotuner_cold_cache", "bare"):
        phases = results["first_step"][side]["phases_s"]
        assert "first step" in phases and all(math.isfinite(v) for v in phases.values())
    (row,) = results["planner"]["rows"]
    assert row["predicted_bytes_per_rank"] > 0
    peak, after = row["measured_peak_bytes_per_rank"][0], row["measured_after_step_bytes_per_rank"]
    assert peak > after[0] > 0  # the in-step peak holds more than what outlives the step
    (lora,) = results["lora_vs_full"]
    assert lora["training_type"] == "lora" and "error" not in lora, lora
    # the bare loop trained the adapter the planner counted, on a frozen base
    assert 0 < lora["bare_trainable_params"] == lora["trainable_params"] < lora["frozen_params"]
    assert lora["predicted_bytes_per_rank"] > 0 and min(lora["measured_peak_bytes_per_rank"]) > 0
    assert lora["checkpoint_bytes"] > lora["output_bytes"] > 0
    (stop,) = results["stops"]["rows"]
    assert (stop["exit_code"], stop["committed_step"]) == (143, stop["last_step"]), stop
    table = js.with_suffix(".md").read_text()
    assert "overhead_ratio" in table and "Time to first step" in table and "Stopping" in table
    assert "LoRA vs full" in table
    assert results["machine"]["torch"] in table


@pytest.mark.slow
def test_gpu_paper_estimate_is_marked_and_complete():
    from bench.paper import headline

    estimate = headline(adam={"elements_per_s": 1e9, "threads": 1})
    assert "ESTIMATE" in estimate
    assert estimate["choice"]["zero_stage"] in (0, 1, 2, 3)
    assert estimate["step_seconds"] > 0 and estimate["flops"]["forward_per_image"] > 1e12
    lora = estimate["lora"]  # the same job as LoRA: the adapter the planner counts
    assert (lora["trainable_params"], lora["frozen_params"]) == (23_224_320, 2_567_463_684)
    assert lora["device_bytes"] < estimate["device_bytes"]
    # backward computes no weight gradients for the frozen base
    assert lora["flops"]["backward_per_image"] < estimate["flops"]["backward_per_image"]


def test_load_peak_row_and_table_put_the_plan_beside_the_measurement(demo_dir, tmp_path):
    from bench.load_peak import OFFLOAD, row, table
    from bench.suites import Bench, preflight_for

    b = Bench(tmp_path, demo_dir / "model", demo_dir / "data", 2, 0, 1, 64)
    pre, _ = preflight_for(b, num_processes=2, **OFFLOAD)  # the config zerotuner would run
    mb = 2**20
    ranks = [
        {
            "loaded_peak_rss_bytes": (900 + r) * mb,
            "engine_ready_peak_rss_bytes": (2_000 + 100 * r) * mb,
            "peak_anon_bytes": (1_900 + r) * mb,
            "peak_file_bytes": (50 + r) * mb,
            "process_start": 10.0,
            "engine_ready": 14.5,
        }
        for r in range(2)
    ]
    full, streamed = (row(path, 2, pre, ranks) for path in ("full_copy", "zero_init"))
    assert (full["path"], full["world_size"], full["zero_stage"], full["offload"]) == (
        "full_copy", 2, 3, "optimizer->nvme, params->nvme",
    )  # fmt: skip
    assert full["params"] == pre.shape.denoiser_params > 0
    assert full["peak_rss_bytes"] == 2_100 * mb and full["engine_ready_seconds"] == 4.5
    assert full["goal_ratio"] == pytest.approx(2_100 * mb / full["goal_bytes"])
    # the planner's load phase: every rank's full fp32 copy vs its partition plus staging
    assert "trained_model_fp32" in full["planned_load_parts_per_rank"]
    assert "trained_model_fp32" not in streamed["planned_load_parts_per_rank"]
    assert streamed["planned_load_bytes_per_rank"] < full["planned_load_bytes_per_rank"]
    failed = {"path": "zero_init", "world_size": 1, "error": "ranks exited 1"}
    text = "\n".join(table([full, failed]))
    assert "| full_copy | fp32 | 2 |" in text and "| 900 / 901 |" in text
    assert "| 2000 / 2100 | 1900 / 1901 ; 50 / 51 |" in text
    assert "| zero_init | fp32 | 1 | failed: ranks exited 1 |" in text
