"""End-of-run pictures from the run records: the loss curve a user looks at first.

Reads OUTPUT/run/steps.jsonl (one StepRecord per line) rather than in-memory state, so the
same picture can be redrawn for any run, including a resumed or a crashed one.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_steps(steps_jsonl: Path) -> list[dict[str, Any]]:
    """The step records, last one winning per step (a resumed run may repeat steps).

    A torn last line (the run was killed mid-write) or a non-finite loss is left out.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(steps_jsonl).read_text().splitlines():
        try:
            record = json.loads(line)
            step, loss = int(record["step"]), float(record["loss"])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(loss):
            by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]


def smooth(values: list[float], *, window: int | None = None) -> list[float]:
    """Trailing moving average; the default window is ~5% of the run (at least 1)."""
    window = window or max(1, len(values) // 20)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve_png(steps_jsonl: Path, out_png: Path, *, title: str = "training loss") -> Path:
    """Plot loss per step (faint) with a smoothed line, and the learning rate on a twin axis."""
    # The object API, not pyplot: no global figure registry or GUI backend to pick (nothing
    # is displayed in a container), and about 0.5 s less to import at every run's end.
    from matplotlib.figure import Figure

    records = read_steps(steps_jsonl)
    steps = [int(r["step"]) for r in records]
    losses = [float(r["loss"]) for r in records]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.subplots()
    if records:
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss")
        ax.plot(steps, smooth(losses), color="tab:blue", linewidth=2, label="smoothed")
        handles = ax.get_lines()
        lrs = [lr for r in records if isinstance(lr := r.get("lr"), int | float)]
        if len(lrs) == len(records):  # every step logged its rate
            twin = ax.twinx()
            (lr_line,) = twin.plot(
                steps, lrs, color="tab:orange", linestyle="--", linewidth=1, label="lr"
            )
            twin.set_ylabel("learning rate", color="tab:orange")
            twin.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
            ax.set_zorder(twin.get_zorder() + 1)  # the loss is drawn over the lr line
            ax.patch.set_visible(False)
            handles.append(lr_line)
        ax.legend(handles=handles, loc="upper right", framealpha=0.9)
    else:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)  # a PNG through Agg, the canvas Figure draws with by default
    log.info("loss curve: %s", out_png)
    return out_png
