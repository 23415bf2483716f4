"""Experiment trackers (`ZT_REPORT_TO`): rank 0's step log, learning rate, memory and samples
mirrored where people look at runs without Prometheus.

`tensorboard`: event files under `OUTPUT/run/tensorboard/`, written by torch's SummaryWriter
(`tensorboard --logdir OUTPUT/run/tensorboard`). A resumed run purges the events after its
checkpoint's step, so the curve continues without the steps the checkpoint does not hold, as
steps.jsonl does. They are run records: `ZT_PUSH_TO` pushes them with `run/`.

Scalars, by tag: `train/loss`, `train/lr`, `train/grad_norm`, `train/step_seconds`,
`train/samples_per_second`, `memory/allocated_gib`, `memory/peak_gib` (the device's; on the
CPU the rank's resident memory), `checkpoint/seconds`; images: `samples/NN-prompt` per sample.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from zerotuner.launch.records import StepRecord
from zerotuner.monitor.metrics import MemoryProbe

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard",)
TENSORBOARD_DIR = "tensorboard"  # under OUTPUT/run/
SAMPLE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
GIB = 1024**3


class TensorBoardSink:
    """A step-record sink (launch.records.Sink) writing TensorBoard event files (rank 0)."""

    def __init__(self, log_dir: Path, *, probe: MemoryProbe | None, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events from a run that went further than the checkpoint it resumes from
        # are dropped at the first new one (TensorBoard's own mechanism)
        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_step + 1 if resumed_step
                                    else None)  # fmt: skip
        self.probe = probe
        log.info("tensorboard: event files in %s", log_dir)

    def on_phase(self, phase: str) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        step, scalars = record.step, {"train/lr": record.lr,
                                      "train/step_seconds": record.step_seconds}  # fmt: skip
        if not record.skipped:
            scalars["train/loss"] = record.loss
        if record.grad_norm is not None and not record.skipped:
            scalars["train/grad_norm"] = record.grad_norm
        if record.step_seconds > 0:
            scalars["train/samples_per_second"] = record.samples / record.step_seconds
        if self.probe is not None:
            memory = self.probe.sample()
            scalars["memory/allocated_gib"] = memory.allocated / GIB
            scalars["memory/peak_gib"] = memory.peak / GIB
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def on_checkpoint(self, step: int, seconds: float) -> None:
        self.writer.add_scalar("checkpoint/seconds", seconds, step)
        self.writer.flush()  # a checkpoint's step is on disk in the curve too

    def on_samples(self, step: int, folder: Path) -> None:
        import numpy as np
        from PIL import Image

        for path in sorted(folder.iterdir()):
            if path.suffix.lower() in SAMPLE_SUFFIXES:
                with Image.open(path) as image:
                    pixels: Any = np.asarray(image.convert("RGB"))
                self.writer.add_image(f"samples/{path.stem}", pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
