"""Where a zerotuner rank's training-loop time goes: `python -m bench.profile [--steps N]`.

On a shared 2-core machine the A/B step times move by +-20% with other people's load, far
more than a 3% overhead target, so this attributes instead of subtracting: py-spy samples
every process of `zerotuner train` (idle time too, so waits in collectives count) and each
sample taken inside `zerotuner.train.loop.train` is put in one bucket by the innermost frame it
holds from a list: DeepSpeed's forward / backward / step (what the bare loop also does)
or the harness's own work (batch loading, noise, sinks, per-step checks). Needs py-spy
(pip install py-spy; not a project dependency) and ptrace permission.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench import runs
from bench.benchmodel import write_bench_model

# (bucket, function, file suffix); the innermost-first search takes the first bucket matched.
BUCKETS = (
    ("engine.forward (DeepSpeed + UNet)", "forward", "deepspeed/runtime/engine.py"),
    ("engine.backward", "backward", "deepspeed/runtime/engine.py"),
    ("engine.step", "step", "deepspeed/runtime/engine.py"),
    ("load_batch (feature cache, safetensors)", "load_batch", "feature_cache.py"),
    ("noise + timesteps + add_noise", "diffusion_loss", "ddpm.py"),
    ("sinks (progress, metrics, steps.jsonl)", "on_step", ""),
    ("after_step (stop check, EMA, checkpoints)", "after_step", "worker.py"),
    ("grad_norm", "grad_norm", "loop.py"),
    ("data iterator", "steps", "worker.py"),
)
BARE_WORK = {"engine.forward (DeepSpeed + UNet)", "engine.backward", "engine.step"}
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:]*)(?::\d+)?\)$")


def _frame(text: str) -> tuple[str, str]:
    """(function name without its class, file) of one py-spy frame ("Cls.fn (file:line)")."""
    match = FRAME.match(text.strip())
    if not match:
        return text, ""
    return match["func"].rsplit(".", 1)[-1], match["file"]


def attribute(raw: str) -> dict[str, int]:
    """Samples per bucket from py-spy's raw (collapsed) output, training loop only."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        loops = [
            i for i, (f, file) in enumerate(frames) if f == "train" and file.endswith("loop.py")
        ]
        if not loops:
            continue
        inner = frames[loops[-1] + 1 :]
        bucket = "loop body (record, loss.item sync, other)"
        for name, func, suffix in BUCKETS:
            if any(f == func and file.endswith(suffix) for f, file in inner):
                bucket = name
                break
        counts[bucket] += int(n)
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw output")
    parser.add_argument("--results", type=Path, default=None, help="add to this results JSON")
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy not found on PATH (pip install py-spy)")
    root = Path(tempfile.mkdtemp(prefix="bench-profile-", dir=runs.REPO / ".cache"))
    try:
        paths = write_bench_model(root / "demo")
        work = root / "run"
        env = runs.zt_env(work, paths.model, paths.data, steps=args.steps)
        raw_file = root / "profile.txt"
        subprocess.run(
            [spy, "record", "--subprocesses", "--idle", "--rate", "50", "--format", "raw",
             "--output", str(raw_file), "--", str(runs.BIN / "zerotuner"), "train"],
            env=runs.base_env() | env, cwd=root, check=True, capture_output=True, text=True,
        )  # fmt: skip
        counts = attribute(raw_file.read_text())
        if args.raw:
            shutil.copyfile(raw_file, args.raw)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = sum(counts.values()) or 1
    harness = sum(v for k, v in counts.items() if k not in BARE_WORK)
    summary = {
        "samples_in_training_loop": total,
        "percent": {k: round(100 * v / total, 2) for k, v in sorted(counts.items())},
        "harness_percent": round(100 * harness / total, 2),
        "note": "all ranks' samples inside zerotuner.train.loop.train; harness = everything but "
        "DeepSpeed's forward, backward and step",
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    if args.results:  # add to a results file written by `python -m bench`
        from bench import report

        results = json.loads(args.results.read_text())
        results["overhead_profile"] = summary
        args.results.write_text(json.dumps(results, indent=2, default=str) + "\n")
        args.results.with_suffix(".md").write_text(report.markdown(results))


if __name__ == "__main__":
    main()
