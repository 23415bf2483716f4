"""`python -m bench [--smoke] [--only SUITE ...]`: run the suites, write bench/results/."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import host, report, runs, suites
from bench.benchmodel import unet_parameters, write_bench_model

SUITES = (
    "overhead", "planner", "lora_vs_full", "nvme", "scaling", "stops", "gpu_paper", "load_peak",
    "load_peak_sdxl", "speed", "base_precision", "base_precision_speed", "optimizers", "notify",
)  # fmt: skip
log = logging.getLogger("bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--only", nargs="+", choices=SUITES, help="run only these suites")
    parser.add_argument("--out", type=Path, default=runs.REPO / "bench" / "results")
    parser.add_argument(
        "--scratch", type=Path, default=None,
        help="working folder on the disk to measure (default: a temp dir under .cache/)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", action="store_true",
        help="with --only: replace just these suites in today's results file",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(runs.REPO / ".cache" / "torch_extensions"))
    wanted = set(args.only or SUITES)

    root = args.scratch or Path(
        tempfile.mkdtemp(prefix="bench-", dir=runs.REPO / ".cache")
    )  # on the repo's disk: tmpfs has no O_DIRECT
    started = time.time()
    results: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "machine": host.machine(),
        "load_start": host.load(),
    }
    try:
        log.info("writing the bench model in %s", root)
        paths = write_bench_model(root / "demo", small=args.smoke)
        results["model"] = {"unet_params": unet_parameters(paths.model)}
        b = suites.Bench(
            root=root, model=paths.model, data=paths.data,
            steps=3 if args.smoke else 14, warmup=1 if args.smoke else 3,
            pairs=1 if args.smoke else 4, disk_mib=64 if args.smoke else 1024,
            smoke=args.smoke,
        )  # fmt: skip
        _, split = suites.preflight_for(b, zero_stage=2, offload_optimizer="none")
        over = bare2 = None
        if wanted & {"overhead", "scaling"}:
            log.info("overhead: zerotuner train vs the bare loop, interleaved")
            over = suites.overhead(b)
            a_runs, b_runs = over["_runs"]
            bare2 = b_runs[-1]
            results["first_step"] = suites.first_step(b, over, split)
            results["first_step"].pop("_bare", None)
            results["overhead"] = over
            log.info("overhead_ratio %.3f", over["overhead_ratio"])
        if "planner" in wanted:
            log.info("planner accuracy")
            results["planner"] = suites.planner(b, bare2)
        if "lora_vs_full" in wanted:
            log.info("LoRA vs full: the same model and stages")
            from bench.lora_vs_full import lora_vs_full

            results["lora_vs_full"] = lora_vs_full(b)
        if "scaling" in wanted and over is not None:
            log.info("scaling: 1 vs 2 ranks")
            results["scaling"] = suites.scaling(b, over["deepspeed_config"], bare2)
        if "nvme" in wanted:
            log.info("NVMe offload vs the raw disk")
            results["nvme"] = suites.nvme(b)
        if "stops" in wanted:
            log.info("stops: SIGTERM at random moments")
            results["stops"] = suites.stops(b, trials=1 if args.smoke else 10)
        if "load_peak" in wanted:
            log.info("load peak: host RSS until the engine is ready, 1 and 2 ranks")
            from bench.load_peak import load_peak

            results["load_peak"] = load_peak(b)
        if "load_peak_sdxl" in wanted and args.only:  # ~1 h and ~52 GB of disk: asked by name
            log.info("load peak, SDXL-size UNet: host RSS until the engine is ready, 2 ranks")
            from bench.load_peak import load_peak_sdxl

            results["load_peak_sdxl"] = load_peak_sdxl(b)
        if "speed" in wanted:
            log.info("speed: the plain loop vs zerotuner (compile off/on), interleaved rounds")
            from bench.speed import speed
            from zerotuner.demo.pipelines import write_demo

            tiny = write_demo(root / "tiny-speed", seed=0, family="sdxl")
            models = {"tiny": (tiny.model, tiny.data), "bench": (b.model, b.data)}
            results["speed"] = speed(b, models, 1 if args.smoke else 3)
        if "base_precision" in wanted:
            log.info("base precision: the frozen base's host bytes, full precision and 8 bits")
            from bench.base_precision import base_precision

            results["base_precision"] = base_precision(b)
        if "base_precision_speed" in wanted:
            log.info("base precision: step time of a LoRA on a base stored in 8 bits")
            from bench.base_precision import speed as base_precision_speed

            results["base_precision_speed"] = base_precision_speed(b, 1 if args.smoke else 2)
        if "optimizers" in wanted:
            log.info("optimizers: state bytes per parameter and step time vs AdamW")
            from bench.optimizers import optimizers

            results["optimizers"] = optimizers(b, rounds=1 if args.smoke else 2)
        if "notify" in wanted:
            log.info("notify: step time with a webhook that answers, fails or hangs")
            from bench.notify import notify

            results["notify"] = notify(b, rounds=1 if args.smoke else 2)
        if "gpu_paper" in wanted:
            from bench.paper import headline

            results["gpu_paper"] = headline()
    finally:
        results["load_end"] = host.load()
        results["wall_seconds"] = time.time() - started
        if args.only and args.merge:
            results = report.merged(results, args.out)
        js, md = report.write(results, args.out)
        log.info("wrote %s and %s", js, md)
        if args.scratch is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
