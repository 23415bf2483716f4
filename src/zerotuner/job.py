"""The resolved job: every decision the entrypoint made, handed to each training rank.

The entrypoint (one per node) turns settings + hardware into a Job, writes it as JSON and
points `ZT_JOB_FILE` at it for the ranks. A rank reads its settings again from the same
environment (secrets never pass through this file) and its decisions from here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB_FILE_ENV = "ZT_JOB_FILE"


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
