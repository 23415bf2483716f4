"""Running `zerotuner train` (the product, through ./entrypoint) for the GPU checks, with its
metrics endpoint scraped while it runs; and bench's bare `deepspeed.initialize` loop on CUDA.

A run's /metrics and /api/run are read every half second: the last reading after a finished
step holds the rank's torch.cuda counters and NVML's view (metrics.CudaMemoryProbe) and the
plan `train` chose, so one run answers the training, metrics and planner checks at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainkit import ENTRYPOINT, REPO, entrypoint_env, free_port

RUN_TIMEOUT = 420  # seconds: one run of the suite takes well under a minute on an H100


def cuda_env(model_dir: Path, out: Path, **overrides: str) -> dict[str, str]:
    """`./entrypoint train` on one GPU (bf16) for the pipeline in model_dir/model and the data in
    model_dir/data, every output under `out`, the metrics endpoint on a free port."""
    env = entrypoint_env(
        model_dir, out, ZT_DEVICE="cuda", ZT_NUM_PROCESSES="1", ZT_MIXED_PRECISION="bf16",
        ZT_METRICS_PORT=str(free_port()), ZT_METRICS_HOST="127.0.0.1",
        ZT_CHECKPOINT_EVERY_STEPS="0",
    )  # fmt: skip
    env.pop("DS_ACCELERATOR", None)  # the tests' conftest sets cpu; train picks cuda itself
    env.pop("OMP_NUM_THREADS", None)  # zerotuner's own rule (cores // ranks): CPU Adam uses it
    env.update(overrides)
    return env


def cpu_env(model_dir: Path, out: Path, **overrides: str) -> dict[str, str]:
    """The same job on DeepSpeed's CPU accelerator (one rank, fp32: no bf16 there)."""
    env = entrypoint_env(
        model_dir, out, ZT_NUM_PROCESSES="1", ZT_MIXED_PRECISION="no",
        ZT_CHECKPOINT_EVERY_STEPS="0", DS_ACCELERATOR="cpu",
    )  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)
    env.update(overrides)
    return env


@dataclass
class Run:
    returncode: int
    log: str
    output: Path
    seconds: float
    metrics: str = ""  # the last /metrics text read after a finished step
    api: dict[str, Any] = field(default_factory=dict)  # the last /api/run read with it
    signalled_at_step: int | None = None
    spawned: float = 0.0  # time.time() when the entrypoint was started

    def first_step_s(self) -> float | None:
        """Seconds from the entrypoint's spawn to its first finished step."""
        steps = self.steps()
        return steps[0]["timestamp"] - self.spawned if steps else None

    def steps(self) -> list[dict[str, Any]]:
        path = self.output / "run" / "steps.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def tail(self, chars: int = 3000) -> str:
        return self.log[-chars:]

    def chosen_row(self) -> dict[str, Any] | None:
        """The plan row `train` chose (plan --json's shape), from the run page's data."""
        plan = self.api.get("plan") or {}
        choice = plan.get("choice")
        for row in plan.get("rows", []):
            if choice and all(row.get(k) == v for k, v in choice.items()):
                return row
        return None


def train(
    env: dict[str, str], *, stop_after_steps: int | None = None, timeout: float = RUN_TIMEOUT
) -> Run:
    """Run `./entrypoint train` to its end; with `stop_after_steps`, SIGTERM it (as `docker
    stop` does: the entrypoint only) once that many steps are in steps.jsonl."""
    output = Path(env["ZT_OUTPUT_DIR"])
    port = int(env.get("ZT_METRICS_PORT", "0"))
    started, spawned = time.monotonic(), time.time()
    proc = subprocess.Popen(
        [ENTRYPOINT, "train"], env=env, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    run = Run(returncode=-1, log="", output=output, seconds=0.0, spawned=spawned)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    steps_file = output / "run" / "steps.jsonl"
    while proc.poll() is None:
        if time.monotonic() - started > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        if port:
            _scrape(port, run)
        if stop_after_steps is not None and run.signalled_at_step is None:
            done = len(steps_file.read_text().splitlines()) if steps_file.is_file() else 0
            if done >= stop_after_steps:
                run.signalled_at_step = done
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    proc.wait()
    reader.join(timeout=10)
    run.returncode, run.log = proc.returncode, "".join(chunks)
    run.seconds = time.monotonic() - started
    return run


def _scrape(port: int, run: Run) -> None:
    try:
        metrics = _get(port, "/metrics").decode()
        if _value(metrics, "zerotuner_steps_total") < 1:
            return
        api = json.loads(_get(port, "/api/run"))
    except (OSError, ValueError):
        return  # not up yet, or going down
    run.metrics, run.api = metrics, api


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
        return response.read()


def samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` in a /metrics text: (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == name
    ]


def _value(metrics: str, name: str) -> float:
    return sum(v for _, v in samples(metrics, name))


def metric(metrics: str, name: str) -> float | None:
    """The one value of `name` (rank 0's), or None when the endpoint had none."""
    found = samples(metrics, name)
    return found[0][1] if found else None


def run_bare_cuda(
    work: Path, model: Path, config: dict[str, Any], *, steps: int, resolution: int
) -> dict[str, Any]:
    """bench.bare (the bare `deepspeed.initialize` loop bench/ times) under torchrun on one GPU,
    with the DeepSpeed config `train` used; returns rank 0's result (step_seconds, memory)."""
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "deepspeed.json"
    config_file.write_text(json.dumps(config, indent=2))
    out = work / "ranks"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    env |= {"DS_ACCELERATOR": "cuda", "PYTHONUNBUFFERED": "1"}
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)  # zerotuner's rule for one rank
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
        f"--master_port={free_port()}", "-m", "bench.bare", "--model", str(model),
        "--config", str(config_file), "--steps", str(steps), "--out", str(out),
        "--resolution", str(resolution),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    (work / "bare.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"bench.bare exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return json.loads((out / "rank-0.json").read_text())


def run_plain_cuda(
    work: Path, model_dir: Path, *, steps: int, resolution: int, batch: int
) -> dict[str, Any]:
    """bench's plain loop (what a user writes by hand: diffusers, torch AdamW, no DeepSpeed)
    on the GPU under bf16 autocast, diffusers' scripts' default (bench.speed.run_plain)."""
    from bench.speed import run_plain

    flags = ("--resolution", str(resolution), "--device", "cuda", "--mixed-precision", "bf16")
    return run_plain(
        work, model_dir / "model", model_dir / "data", steps=steps, batch=batch, flags=flags
    )


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"
