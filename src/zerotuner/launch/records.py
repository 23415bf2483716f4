"""What a training rank reports: per-step records for the sinks, and its exit status.

The loop builds one StepRecord per optimizer step and hands it to every sink (steps.jsonl,
Prometheus, the progress log). torchrun exits 1 for any failure, so each rank also writes its
own exit code and reason to `ZT_STATUS_DIR`; the entrypoint maps those to the public codes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

STATUS_DIR_ENV = "ZT_STATUS_DIR"


@dataclass(frozen=True)
class StepRecord:
    step: int  # optimizer steps finished so far (1-based)
    loss: float  # mean over the step's micro-batches on this rank
    lr: float
    grad_norm: float | None
    step_seconds: float  # wall time of this optimizer step
    samples: int  # samples in this step across all ranks
    timestamp: float  # time.time() when the step finished
    skipped: bool = False  # non-finite loss or gradient norm: the weights did not change

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Sink(Protocol):
    """Anything that consumes the loop's reports. A sink subclasses this and overrides what it
    acts on; every hook's default does nothing, so callers call each one directly."""

    def on_phase(self, phase: str) -> None:
        return None

    def on_step(self, record: StepRecord) -> None:
        return None

    def on_checkpoint(self, step: int, seconds: float) -> None:
        return None

    def on_eval(self, step: int, loss: float) -> None:
        """The held-out loss after `step` (the same on every rank), heard before the step's
        own record (on_step)."""
        return None

    def on_dataset_skipped(self, count: int) -> None:
        """Dataset files the scan left out (rank 0 reports them once)."""
        return None

    def on_samples(self, step: int, folder: Path) -> None:
        """The validation samples of `step`, rendered into `folder`."""
        return None

    def unfinished(self) -> None:
        """The run ends without finishing (a failure, a stop), before close."""
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class RankStatus:
    rank: int
    exit_code: int
    message: str = ""
    # ended by a signal it could not handle (SIGKILL): torchrun's agent wrote it for the rank.
    # Its line is the cause of the others' (a peer's broken connection), so it is told first.
    killed: bool = False


def write_rank_status(rank: int, exit_code: int, message: str = "", killed: bool = False) -> None:
    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    path = Path(folder) / f"rank-{rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(RankStatus(rank, exit_code, message, killed))))
    os.replace(tmp, path)


def killed_line(rank: int, signal_name: str) -> str:
    """A rank's one line when a signal it cannot handle ended it."""
    why = (" without a stop request: most often the kernel's out-of-memory killer (see the "
           "node's memory, `dmesg`); `zerotuner plan` says what the run needs"
           if signal_name == "SIGKILL" else "")  # fmt: skip
    return f"rank {rank} was killed by {signal_name}{why}"


def write_rank_armed(rank: int) -> None:
    """Mark that this rank handles SIGTERM from now on (train.stop.StopRequest): stopped, it
    writes a status. A rank the signal ends before this had not trained: nothing to save."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if folder:
        (Path(folder) / f"rank-{rank}.armed").touch()


def read_armed_ranks(folder: Path) -> set[int]:
    return {int(p.stem[5:]) for p in folder.glob("rank-*.armed") if p.stem[5:].isdigit()}


def read_rank_statuses(folder: Path) -> list[RankStatus]:
    statuses = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            statuses.append(RankStatus(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a rank killed mid-write leaves no usable status: treated as unknown
    return statuses
