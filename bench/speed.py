"""The speed suite: zerotuner vs the plain loop a user would write (`bench.plain_loop`).

One process, batch 4, 64 px, fp32, the same model, data and AdamW settings; per model (the
demo's tiny UNet and the bench's SDXL-shaped UNet) every round runs each variant once, in
the same order (plain, plain with torch's fused AdamW, ZeRO-0, ZeRO-0 compiled, ZeRO-2, ZeRO-2
compiled), so a burst of load
from others on the shared machine hits one round, not one variant. Per run: steady s/step
(median after the warm-up steps), time to first step and wall time, both from the moment the
process is spawned. Per round: each zerotuner variant's ratio to that round's plain run; the
result is the median over rounds. The first compiled run of a model pays inductor's cold
compile (its kernel cache is empty); later rounds find the cache warm, and both are reported.

`python -m bench.speed [--smoke] [--rounds N]` runs it alone and writes `speed` into today's
results file (bench/results/<date>.json), keeping the other suites.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import host, runs
from bench.suites import Bench, median, steady

log = logging.getLogger("bench")
BATCH = 4
VARIANTS = (  # name, ZT_* for zerotuner, or (a tuple) the plain loop's flags
    ("plain", ()),
    ("plain-fused", ("--fused-adamw",)),
    ("zt-z0", {"zero_stage": 0, "compile": "false"}),
    ("zt-z0-compile", {"zero_stage": 0, "compile": "true"}),
    ("zt-z2", {"zero_stage": 2, "compile": "false"}),
    ("zt-z2-compile", {"zero_stage": 2, "compile": "true"}),
)


def run_plain(
    work: Path,
    model: Path,
    data: Path,
    *,
    steps: int,
    batch: int = BATCH,
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """bench.plain_loop to its end (`flags`: its other options, e.g. --device cuda); its step
    times and losses, and its first step and wall time counted from the spawn."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "plain.json"
    cmd = [sys.executable, "-m", "bench.plain_loop", "--model", str(model), "--data", str(data),
           "--out", str(out), "--steps", str(steps), "--batch", str(batch), *flags]  # fmt: skip
    spawned = time.time()
    done = subprocess.run(cmd, env=runs.base_env(), cwd=runs.REPO, capture_output=True,
                          text=True, timeout=runs.TIMEOUT)  # fmt: skip
    ended = time.time()
    (work / "plain.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"plain loop exited {done.returncode}; log in {work}/plain.log")
    r = json.loads(out.read_text())
    return {"step_seconds": r["step_seconds"], "losses": r["losses"],
            "first_step_s": r["times"]["first_step"] - spawned, "wall_s": ended - spawned,
            "threads": r["threads"]}  # fmt: skip


def run_zerotuner(work: Path, model: Path, data: Path, *, steps: int, **zt: Any) -> dict[str, Any]:
    env = runs.zt_env(work, model, data, steps=steps, num_processes=1, train_batch_size=BATCH,
                      offload_optimizer="none", offload_param="none", **zt)  # fmt: skip
    r = runs.run_product(work, env)
    graphs = [line for line in r.log.splitlines() if "graphs compiled" in line]
    return {"step_seconds": [x["step_seconds"] for x in r.steps],
            "losses": [x["loss"] for x in r.steps],
            "first_step_s": r.steps[0]["timestamp"] - r.spawned, "wall_s": r.ended - r.spawned,
            "graphs": graphs[-1].rsplit("speed: ", 1)[-1] if graphs else None,
            # when the plan was logged, the ranks released, loading and caching began
            "marks_s": {k: v - r.spawned for k, v in r.marks.items()}}  # fmt: skip


def speed(b: Bench, models: dict[str, tuple[Path, Path]], rounds: int) -> dict[str, Any]:
    """Interleaved rounds of every variant on every model; rows for the results JSON."""
    rows = []
    for name, (model, data) in models.items():
        runs_by_variant: dict[str, list[dict]] = {v: [] for v, _ in VARIANTS}
        for i in range(rounds):
            for variant, zt in VARIANTS:
                work = b.work(f"speed-{name}-{variant}-{i}")
                log.info("speed: %s %s round %d", name, variant, i)
                try:
                    if isinstance(zt, dict):
                        r = run_zerotuner(work, model, data, steps=b.steps, **zt)
                    else:
                        r = run_plain(work, model, data, steps=b.steps, flags=zt)
                except RuntimeError as error:  # keep the other runs; say what failed
                    r = {"error": str(error)}
                r["steady_s"] = (median(steady(r["step_seconds"], b.warmup))
                                 if "step_seconds" in r else None)  # fmt: skip
                runs_by_variant[variant].append(r)
        plain = runs_by_variant["plain"]
        for variant, _ in VARIANTS:
            done = runs_by_variant[variant]
            rows.append(_row(name, variant, done, plain))
    return {
        "setup": f"1 process, batch {BATCH}, 64 px, fp32, AdamW lr 1e-4 wd 1e-2; "
        f"{b.steps} steps per run, the first {b.warmup} not steady; {rounds} interleaved rounds",
        "order": [v for v, _ in VARIANTS],
        "rows": rows,
        "ratio_method": "per round: plain's steady s/step / the variant's (speedup > 1 = "
        "faster than the plain loop) and the variant's first step / plain's; medians over rounds",
    }


def _row(model: str, variant: str, done: list[dict], plain: list[dict]) -> dict[str, Any]:
    def ok(r: dict) -> bool:
        return r.get("steady_s") is not None

    pairs = [(r, p) for r, p in zip(done, plain, strict=True) if ok(r) and ok(p)]
    return {
        "model": model,
        "variant": variant,
        "steady_s": [r.get("steady_s") for r in done],
        "first_step_s": [r.get("first_step_s") for r in done],
        "wall_s": [r.get("wall_s") for r in done],
        "speedup_vs_plain": median([p["steady_s"] / r["steady_s"] for r, p in pairs]),
        "first_step_ratio_vs_plain": median(
            [r["first_step_s"] / p["first_step_s"] for r, p in pairs]
        ),
        "wall_ratio_vs_plain": median([r["wall_s"] / p["wall_s"] for r, p in pairs]),
        "graphs": [r.get("graphs") for r in done],
        "errors": [r["error"] for r in done if "error" in r] or None,
        "runs": done,
    }


def table(result: dict[str, Any]) -> list[str]:
    """Markdown: one line per model and variant (medians; the first round's first step too,
    where a compiled run paid the cold compile)."""
    out = [
        "| model | variant | steady s/step | speedup vs plain | first step s (round 1 / median) "
        "| first step vs plain | wall s | wall vs plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        steady_s = [x for x in r["steady_s"] if x is not None]
        first = [x for x in r["first_step_s"] if x is not None]
        wall = [x for x in r["wall_s"] if x is not None]
        out.append(
            f"| {r['model']} | {r['variant']} | {median(steady_s):.3f} | "
            f"{r['speedup_vs_plain']:.2f}x | {first[0] if first else float('nan'):.1f} / "
            f"{median(first):.1f} | {r['first_step_ratio_vs_plain']:.2f}x | {median(wall):.1f} "
            f"| {r['wall_ratio_vs_plain']:.2f}x |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="the smoke UNet only, 3 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=runs.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from bench.benchmodel import unet_parameters, write_bench_model
    from zerotuner.demo.pipelines import write_demo

    root = Path(tempfile.mkdtemp(prefix="bench-speed-", dir=runs.REPO / ".cache"))
    started = time.time()
    load_start = host.load()
    tiny = write_demo(root / "tiny", seed=0, family="sdxl")
    models = {"tiny": (tiny.model, tiny.data)}
    if not args.smoke:
        big = write_bench_model(root / "demo")
        models["bench"] = (big.model, big.data)
    b = Bench(root=root, model=tiny.model, data=tiny.data, steps=3 if args.smoke else args.steps,
              warmup=1 if args.smoke else 3, pairs=args.rounds, disk_mib=0,
              smoke=args.smoke)  # fmt: skip
    params = {k: unet_parameters(m) for k, (m, _) in models.items()}  # before the folder goes
    try:
        result = speed(b, models, 1 if args.smoke else args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["params"] = params
    result |= {"load_start": load_start, "load_end": host.load(),
               "wall_seconds": time.time() - started, "machine": host.machine(),
               "started_utc": datetime.fromtimestamp(started, UTC).isoformat(
                   timespec="seconds")}  # fmt: skip
    stem = datetime.now(UTC).strftime("%Y-%m-%d") + ("-smoke" if args.smoke else "")
    path = args.out / f"{stem}.json"
    # A new file gets the top-level keys bench/report.py reads, so `python -m bench --merge`
    # can add the other suites to it later.
    results = json.loads(path.read_text()) if path.exists() else {
        "date": stem[:10], "started_utc": result["started_utc"], "smoke": args.smoke,
        "machine": result["machine"], "load_start": load_start, "load_end": result["load_end"],
        "wall_seconds": result["wall_seconds"],
        "model": {"unet_params": result["params"].get("bench", result["params"]["tiny"])},
    }  # fmt: skip
    results["speed"] = result
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    (args.out / f"{stem}-speed.md").write_text("\n".join(table(result)) + "\n")
    log.info("wrote %s (speed)", path)
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
