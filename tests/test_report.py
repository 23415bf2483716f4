"""The loss curve is drawn from steps.jsonl as a resumed or killed run leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from zerotuner.launch.records import StepRecord
from zerotuner.monitor.report import loss_curve_png, read_steps, smooth


def _write_steps(path: Path, losses: dict[int, float], *, torn: bool = False) -> Path:
    lines = [
        StepRecord(step, loss, 1e-4, None, 0.2, 8, 1_700_000_000.0 + step).to_json()
        for step, loss in losses.items()
    ]
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 999, "lo'  # killed mid-write
    path.write_text(text)
    return path


def test_read_steps_keeps_the_last_record_per_step_and_drops_junk(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    _write_steps(path, {1: 2.0, 2: 1.5, 3: float("nan")}, torn=True)
    with path.open("a") as f:  # a resumed run repeats step 2
        f.write("\n" + json.dumps({"step": 2, "loss": 1.25, "lr": 1e-4}) + "\n")
    records = read_steps(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 1.25)]


def test_smooth_is_a_trailing_mean() -> None:
    assert smooth([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([4.0, 2.0]) == [4.0, 2.0]  # window 1 for short runs


def test_loss_curve_png_is_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    losses = {s: float(1.0 / s + 0.05 * rng.random()) for s in range(1, 101)}
    steps = _write_steps(tmp_path / "steps.jsonl", losses, torn=True)
    out = loss_curve_png(steps, tmp_path / "plots" / "loss.png")
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (800, 450)
        assert len(image.convert("RGB").getcolors(1 << 16)) > 10  # something was drawn


def test_loss_curve_png_without_steps_still_writes(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text("")
    out = loss_curve_png(steps, tmp_path / "loss.png")
    assert out.stat().st_size > 0
