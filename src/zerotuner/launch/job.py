"""The resolved job: every decision the entrypoint made, handed to each training rank.

The entrypoint (one per node) turns settings + hardware into a Job, writes it as JSON and
points `ZT_JOB_FILE` at it for the ranks. A rank reads its settings again from the same
environment (secrets never pass through this file) and its decisions from here.

The ranks start before the job is decided (`launch.start_ranks`), so their imports overlap the
entrypoint's planning; each waits in `wait_for_job` until the file appears.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB_FILE_ENV = "ZT_JOB_FILE"
LAUNCHER_PID_ENV = "ZT_LAUNCHER_PID"  # the entrypoint that will write the job file


@dataclass(frozen=True)
class Job:
    family: str  # sdxl | sd1 | sd2
    model: str  # local folder or hub id, as loaded by diffusers
    resolution: int
    zero_stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str  # none | cpu | nvme
    gradient_checkpointing: bool
    mixed_precision: str  # bf16 | fp16 | no
    device: str  # cuda | cpu
    world_size: int
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    revision: str | None = None  # a hub model's commit, as the entrypoint read its configs
    # the trained network's parameter count: checkpoint manifests record it, so a resume onto
    # a model of other shapes is refused before any rank loads (checkpoint.check_model)
    denoiser_params: int | None = None
    # `cpu`: the checkpointed blocks' inputs wait in host memory (ZT_OFFLOAD_ACTIVATIONS)
    offload_activations: str = "none"
    deepspeed: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what was decided and why, for the log

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Job:
        data = json.loads(text)
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path


def load_job(path: str | os.PathLike[str] | None = None) -> Job:
    path = path or os.environ[JOB_FILE_ENV]
    return Job.from_json(Path(path).read_text())


def wait_for_job(path: str | os.PathLike[str] | None = None, *, poll: float = 0.02) -> Path:
    """The job file, once the entrypoint has written it (atomically: `Job.write`).

    An entrypoint that gives up before (a refused setting, a signal) kills the waiting ranks;
    one that died without doing so leaves them nothing to wait for: they exit (status 1)."""
    found = Path(path or os.environ[JOB_FILE_ENV])
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    while not found.exists():
        if launcher and not _alive(int(launcher)):
            raise SystemExit(1)
        time.sleep(poll)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or a reused pid that is not ours
        return False
    return True
