"""What the run page at the metrics port's `/` shows, read from what the run records anyway.

- loss, step and ETA: OUTPUT/run/steps.jsonl (rank 0 writes it), read incrementally;
- step time and device memory per rank over time: the metrics every rank already writes,
  sampled by the entrypoint's server thread every few seconds (step time is the mean over the
  interval, from the step histogram's sum and count);
- validation samples: the newest OUTPUT/samples/step-N/ folder (a video family's clip, NN.mp4,
  beside its contact sheet NN.png), each with the input image it sampled from (OUTPUT/samples/
  inputs/NN.png: Wan image-to-video, FLUX.1 Kontext);
- the plan (handed over by `train`) and the effective DeepSpeed config (OUTPUT/run/
  deepspeed.json, else the job's).
Nothing here runs in a rank: the training step does no extra work, and the page only reads.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

STEP_HISTOGRAM = "zerotuner_step_duration_seconds"
MEMORY = "zerotuner_device_memory_allocated_bytes"
MAX_STEPS = "zerotuner_max_steps"
MAX_POINTS = 1000  # per series in an answer, and per rank in the history
ETA_WINDOW = 20  # steps the ETA averages over (validation and checkpoints included)
# What the page links to; bounded, so no name reaches the file system too long for it.
SAMPLE_FILE = re.compile(r"(step-\d{1,18}|base|inputs)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.(png|mp4)")
SAMPLE_TYPES = {".png": "image/png", ".mp4": "video/mp4"}


class StepsLog:
    """steps.jsonl, read from where the last read stopped. A resume rewrites the file from its
    checkpoint's step on: a file whose tail no longer matches is read again from the start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._tail = b""
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                with self.path.open("rb") as file:
                    if self._offset and not self._continues(file):
                        self.records, self._offset, self._tail = [], 0, b""
                    file.seek(self._offset)
                    data = file.read()
            except OSError:
                return self.records
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            for line in data[:end].splitlines():
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a crash
            if end:
                self._offset += end
                self._tail = data[max(0, end - 256) : end]
            return self.records

    def _continues(self, file: Any) -> bool:
        start = self._offset - len(self._tail)
        file.seek(start)
        return file.read(len(self._tail)) == self._tail


def thin(points: list[Any], limit: int = MAX_POINTS) -> list[Any]:
    """At most `limit` points, evenly strided, the last one always kept."""
    if len(points) <= limit:
        return points
    stride = -(-len(points) // limit)
    kept = points[::stride]
    return kept if kept[-1] is points[-1] else [*kept, points[-1]]


class RankHistory:
    """Per rank: (time, mean step seconds since the previous sample, device memory bytes).

    When a rank's series is full, every other point goes: the whole run stays on the page at a
    resolution that halves as it grows."""

    def __init__(self, limit: int = MAX_POINTS) -> None:
        self.limit = limit
        self.series: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        self._last: dict[str, tuple[float, float]] = {}  # rank -> (histogram sum, count)
        self._lock = threading.Lock()

    def add(self, families: list[Any], now: float) -> None:
        sums: dict[str, dict[str, float]] = {}
        memory: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                rank = sample.labels.get("rank")
                if rank is None:
                    continue
                if sample.name in (f"{STEP_HISTOGRAM}_sum", f"{STEP_HISTOGRAM}_count"):
                    sums.setdefault(rank, {})[sample.name.rsplit("_", 1)[1]] = sample.value
                elif sample.name == MEMORY:
                    memory[rank] = sample.value
        with self._lock:
            for rank in sorted(set(sums) | set(memory), key=_rank_order):
                step_seconds = None
                if "sum" in sums.get(rank, {}) and "count" in sums[rank]:
                    total, count = sums[rank]["sum"], sums[rank]["count"]
                    before_total, before_count = self._last.get(rank, (0.0, 0.0))
                    if count > before_count:
                        step_seconds = (total - before_total) / (count - before_count)
                    self._last[rank] = (total, count)
                points = self.series.setdefault(rank, deque())
                points.append((now, step_seconds, memory.get(rank)))
                if len(points) > self.limit:
                    kept = list(points)[::2]
                    points.clear()
                    points.extend(kept)

    def as_dict(self) -> dict[str, dict[str, list[Any]]]:
        with self._lock:
            return {
                rank: {
                    "t": [p[0] for p in points],
                    "step_seconds": [p[1] for p in points],
                    "memory_bytes": [p[2] for p in points],
                }
                for rank, points in self.series.items()
            }


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


class RunView:
    """The run page's data: `state()` answers /api/run, `sample_path()` the sample files."""

    def __init__(self, output_dir: Path | None, *, history_limit: int = MAX_POINTS) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None else None
        run = self.output_dir / "run" if self.output_dir else None
        self.steps = StepsLog(run / "steps.jsonl") if run else None
        self.history = RankHistory(history_limit)
        self.job: dict[str, Any] | None = None
        self.plan: dict[str, Any] | None = None

    def state(self, families: list[Any], phase: str) -> dict[str, Any]:
        records = self.steps.read() if self.steps else []
        last = records[-1] if records else None
        max_steps = _max_steps(families)
        return {
            "phase": phase,
            "step": last["step"] if last else 0,
            "max_steps": max_steps,
            "eta_seconds": _eta(records, max_steps),
            "loss": thin([[r["step"], r["loss"]] for r in records]),
            # the held-out loss (ZT_EVAL_*), at the evaluated steps only
            "eval_loss": thin([[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r]),
            "step_seconds": thin([[r["step"], r["step_seconds"]] for r in records]),
            "ranks": {
                rank: {key: thin(values) for key, values in series.items()}
                for rank, series in self.history.as_dict().items()
            },
            "samples": self._samples(),
            "plan": self.plan,
            "deepspeed": self._deepspeed(),
            "job": {k: v for k, v in (self.job or {}).items() if k not in ("deepspeed", "notes")},
            "now": time.time(),
        }

    def _deepspeed(self) -> dict[str, Any] | None:
        if self.output_dir is not None:
            try:
                return json.loads((self.output_dir / "run" / "deepspeed.json").read_text())
            except (OSError, ValueError):
                pass
        return (self.job or {}).get("deepspeed")

    def _samples(self) -> dict[str, Any] | None:
        folder = self.output_dir / "samples" if self.output_dir else None
        if folder is None or not folder.is_dir():
            return None
        steps = [(int(p.name[5:]), p) for p in folder.glob("step-*") if p.name[5:].isdigit()]
        newest = [p for _, p in sorted(steps) if any(p.glob("*.png"))]
        if not newest:
            return None
        latest = newest[-1]
        prompts: dict[int, str] = {}
        try:
            for i, line in enumerate((latest / "prompts.txt").read_text().splitlines()):
                prompts[i] = line.split("\t", 1)[-1]
        except OSError:
            pass  # written after the images: the file names say the prompts meanwhile
        images = []
        for path in sorted(latest.glob("*.png")):
            index = int(path.name[:2]) if path.name[:2].isdigit() else -1
            prompt = prompts.get(index, path.stem[3:].replace("-", " "))
            image = {"prompt": prompt, "url": f"/run/samples/{latest.name}/{path.name}"}
            if path.with_suffix(".mp4").is_file():  # a clip, the PNG its contact sheet
                image["video"] = f"/run/samples/{latest.name}/{path.stem}.mp4"
            if (folder / "inputs" / path.name).is_file():  # the input image it sampled from
                image["input"] = f"/run/samples/inputs/{path.name}"
            images.append(image)
        return {"step": int(latest.name[5:]), "images": images}

    def sample_image(self, relative: str) -> bytes | None:
        """A PNG or MP4 under OUTPUT/samples (step-N/, base/ or inputs/), else None."""
        found = self.sample_path(relative)
        return found[0].read_bytes() if found is not None else None

    def sample_path(self, relative: str) -> tuple[Path, str] | None:
        """A sample file's path and media type (SAMPLE_TYPES), else None: a name the page never
        links to (a 5000-digit step, `..`, a link leaving the folder) is not looked up."""
        if self.output_dir is None or not SAMPLE_FILE.fullmatch(relative):
            return None
        root = (self.output_dir / "samples").resolve()
        try:
            path = (root / relative).resolve()
            if path.parent.parent != root or path.suffix not in SAMPLE_TYPES or not path.is_file():
                return None
        except OSError:
            return None
        return path, SAMPLE_TYPES[path.suffix]


def _max_steps(families: list[Any]) -> int | None:
    for family in families:
        if family.name == MAX_STEPS:
            values = [s.value for s in family.samples]
            if values:
                return int(max(values))
    return None


def _eta(records: list[dict[str, Any]], max_steps: int | None) -> float | None:
    """Seconds left at the recent pace (wall time per step, so validation and checkpoints
    count), None before two steps or without a target."""
    if max_steps is None or len(records) < 2:
        return None
    window = records[-ETA_WINDOW:]
    steps = window[-1]["step"] - window[0]["step"]
    if steps <= 0:
        return None
    per_step = (window[-1]["timestamp"] - window[0]["timestamp"]) / steps
    return max(0.0, (max_steps - window[-1]["step"]) * per_step)
