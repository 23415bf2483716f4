"""The consumers of a rank's step records (launch.records.Sink), plugged in one place: the
Prometheus metrics and the progress log (zerotuner.monitor) on every rank, and steps.jsonl,
the run's step history, and the trackers of ZT_REPORT_TO (monitor.trackers) on rank 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from zerotuner.launch import distributed
from zerotuner.launch.job import Job
from zerotuner.launch.records import Sink, StepRecord
from zerotuner.settings.schema import Settings
from zerotuner.weights import checkpoint


def build_sinks(
    settings: Settings, job: Job, *, world: distributed.World, resume: Path | None
) -> list[Sink]:
    """Every consumer of step records on this rank. `resume`: the checkpoint this run
    continues from (its step starts the progress count)."""
    from zerotuner.monitor.logs import ProgressSink
    from zerotuner.monitor.metrics import PrometheusSink

    rank, device = world.rank, world.device
    start = int((checkpoint.read_manifest(resume) or {}).get("step", 0)) if resume else 0
    sinks: list[Sink] = [
        PrometheusSink(
            rank, device=device, world_size=job.world_size, max_steps=settings.max_steps
        ),
        ProgressSink(
            rank,
            max_steps=settings.max_steps,
            every_steps=settings.log_every_steps,
            start_step=start,
            device=device,
        ),
    ]
    if rank == 0:
        sinks.append(StepsJsonlSink(settings.output_dir / "run" / "steps.jsonl"))
        if settings.report_to:
            from zerotuner.monitor import trackers
            from zerotuner.monitor.metrics import memory_probe

            probe = memory_probe(device)
        if "tensorboard" in settings.report_to:
            folder = settings.output_dir / "run" / trackers.TENSORBOARD_DIR
            sinks.append(trackers.TensorBoardSink(folder, probe=probe, resumed_step=start))
        if "wandb" in settings.report_to:
            sinks.append(trackers.WandbSink(settings, probe=probe))
    return sinks


class StepsJsonlSink(Sink):
    """OUTPUT/run/steps.jsonl: one line per optimizer step (rank 0). At the first record, lines
    from that step on are dropped (left by a run that went further than its last checkpoint),
    so after a resume the file continues with the next step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None
        self._eval: tuple[int, float] | None = None  # heard before its step's record

    def _open(self, first_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash
        self.path.write_text("".join(f"{line}\n" for line in kept))
        self._file = self.path.open("a", buffering=1)

    def on_eval(self, step: int, loss: float) -> None:
        self._eval = (step, loss)

    def on_step(self, record: StepRecord) -> None:
        if self._file is None:
            self._open(record.step)
        line = {
            "step": record.step,
            "loss": _finite_or_none(record.loss),  # strict JSON: no NaN or Infinity
            "lr": record.lr,
            "step_seconds": round(record.step_seconds, 6),
            "samples": record.samples,
            "grad_norm": _finite_or_none(record.grad_norm),
            "timestamp": record.timestamp,
            "skipped": record.skipped,  # non-finite: the weights did not change (nonfinite)
        }
        if self._eval is not None and self._eval[0] == record.step:
            line["eval_loss"] = _finite_or_none(self._eval[1])  # the held-out loss (evaluate)
            self._eval = None
        self._file.write(json.dumps(line) + "\n")

    def on_checkpoint(self, step: int, seconds: float) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
