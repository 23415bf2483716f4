"""Experiment trackers (`ZT_REPORT_TO`): rank 0's step log, learning rate, memory and samples
mirrored where people look at runs without Prometheus.

`tensorboard`: event files under `OUTPUT/run/tensorboard/`, written by torch's SummaryWriter
(`tensorboard --logdir OUTPUT/run/tensorboard`). A resumed run purges the events after its
checkpoint's step, so the curve continues without the steps the checkpoint does not hold, as
steps.jsonl does. They are run records: `ZT_PUSH_TO` pushes them with `run/`.

`wandb`: a Weights & Biases run in project `ZT_WANDB_PROJECT`, online with an API key
(`WANDB_API_KEY` or the secret file `wandb_api_key`), offline without one (`ZT_WANDB_MODE`):
its files under `OUTPUT/run/wandb/`, for `wandb sync` later. Its config is the run's settings,
secrets masked. Values are logged against the training step as `step` (W&B's own step counter
only grows, so a resumed run's steps would be refused), and the run id is kept in
`OUTPUT/run/wandb/run-id`, so a resume continues the same W&B run.

Values, by name: `train/loss`, `train/lr`, `train/grad_norm`, `train/step_seconds`,
`train/samples_per_second`, `memory/allocated_gib`, `memory/peak_gib` (the device's; on the
CPU the rank's resident memory), `checkpoint/seconds`; images: `samples/NN-prompt` per sample.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

from zerotuner.errors import ConfigError
from zerotuner.launch.records import Sink, StepRecord
from zerotuner.monitor.metrics import MemoryProbe
from zerotuner.settings.schema import Settings, env_name, masked_dump

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"  # under OUTPUT/run/
WANDB_DIR = "wandb"  # under OUTPUT/run/
SAMPLE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
GIB = 1024**3


def _scalars(record: StepRecord, probe: MemoryProbe | None) -> dict[str, float]:
    """A step record's values, by tracker name; a skipped (non-finite) step has no loss or
    gradient norm, as steps.jsonl has null."""
    values = {"train/lr": record.lr, "train/step_seconds": record.step_seconds}
    if not record.skipped:
        values["train/loss"] = record.loss
        if record.grad_norm is not None:
            values["train/grad_norm"] = record.grad_norm
    if record.step_seconds > 0:
        values["train/samples_per_second"] = record.samples / record.step_seconds
    if probe is not None:
        memory = probe.sample()
        values["memory/allocated_gib"] = memory.allocated / GIB
        values["memory/peak_gib"] = memory.peak / GIB
    return values


def _sample_images(folder: Path) -> list[tuple[str, Any]]:
    """(name, HWC uint8 pixels) of each image of a samples folder."""
    import numpy as np
    from PIL import Image

    images = []
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in SAMPLE_SUFFIXES:
            with Image.open(path) as image:
                images.append((f"samples/{path.stem}", np.asarray(image.convert("RGB"))))
    return images


class TensorBoardSink(Sink):
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
        for tag, value in _scalars(record, self.probe).items():
            self.writer.add_scalar(tag, value, record.step)

    def on_eval(self, step: int, loss: float) -> None:
        self.writer.add_scalar("eval/loss", loss, step)

    def on_checkpoint(self, step: int, seconds: float) -> None:
        self.writer.add_scalar("checkpoint/seconds", seconds, step)
        self.writer.flush()  # a checkpoint's step is on disk in the curve too

    def on_samples(self, step: int, folder: Path) -> None:
        for name, pixels in _sample_images(folder):
            self.writer.add_image(name, pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode(settings: Settings) -> Literal["online", "offline"]:
    """online or offline, as ZT_WANDB_MODE asks (auto: online with an API key); ConfigError
    for online without one. The entrypoint checks it before the ranks start; rank 0 gets the
    same answer from the same settings."""
    key = settings.wandb_api_key
    if settings.wandb_mode == "online" and key is None:
        raise ConfigError(
            f"{env_name('wandb_mode')}=online needs a W&B API key: set WANDB_API_KEY or the "
            f"secret file wandb_api_key in {env_name('secrets_dir')}, or use "
            f"{env_name('wandb_mode')}=offline (files to `wandb sync` later)"
        )
    if settings.wandb_mode == "auto":
        return "online" if key is not None else "offline"
    return settings.wandb_mode


class WandbSink(Sink):
    """A step-record sink (launch.records.Sink) logging to a W&B run (rank 0)."""

    def __init__(self, settings: Settings, *, probe: MemoryProbe | None) -> None:
        import wandb
        from wandb.sdk.lib.runid import generate_id

        folder = settings.output_dir / "run" / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        mode = wandb_mode(settings)
        if settings.wandb_api_key is not None:  # wandb reads it there; the log masks it
            os.environ["WANDB_API_KEY"] = settings.wandb_api_key.get_secret_value()
        id_file = folder / "run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=settings.wandb_project, dir=str(folder), id=run_id, resume="allow",
            mode=mode, name=settings.output_dir.name, config=masked_dump(settings),
            # console off: our log lines stay ours, not wrapped by wandb's capture
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.probe = probe
        log.info("wandb: run %s in project %s, %s (files in %s)", run_id,
                 settings.wandb_project, mode, folder)  # fmt: skip

    def on_phase(self, phase: str) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        self.run.log({"step": record.step, **_scalars(record, self.probe)})

    def on_eval(self, step: int, loss: float) -> None:
        self.run.log({"step": step, "eval/loss": loss})

    def on_checkpoint(self, step: int, seconds: float) -> None:
        self.run.log({"step": step, "checkpoint/seconds": seconds})

    def on_samples(self, step: int, folder: Path) -> None:
        import wandb

        images = {name: wandb.Image(pixels) for name, pixels in _sample_images(folder)}
        if images:
            self.run.log({"step": step, **images})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb's service has written the last records of an offline
        # run: teardown waits for it, so run/wandb is whole when the rank exits
        wandb.teardown()
