"""The ranks' process group: joining it, the collectives the worker's phases share, leaving it.

A lone process (no torchrun) is rank 0 of 1 and every collective here is then a no-op.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def init_distributed(*, device: str, master_addr: str, master_port: int) -> tuple[int, int]:
    """Join the process group torchrun described (gloo on CPU); returns (rank, world size)."""
    import deepspeed

    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, default)
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if not dist.is_initialized():
        # On the CPU every rank prints "DeepSpeed ...shm_comm_op built successfully": a debug
        # line, unless joining fails and what was printed may say why.
        printed = io.StringIO()
        failed = True
        try:
            with contextlib.redirect_stdout(printed):
                deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
            failed = False
        finally:
            if text := printed.getvalue().strip():
                log.log(logging.WARNING if failed else logging.DEBUG, "%s", text)
    return dist.get_rank(), dist.get_world_size()


def node_leader(rank: int, world: int) -> tuple[int, int] | None:
    """(this node's index, the number of nodes) on each node's first local rank, else None.
    torchrun numbers the ranks of a node contiguously, LOCAL_WORLD_SIZE per node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    return rank // local, max(1, world // local)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_sum(values: list[int]) -> list[int]:
    """Each value summed over the ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def leave_group() -> None:
    """Destroy the process group before exit: a gloo group left to the interpreter's
    teardown can abort the process (SIGABRT) when a peer has already gone."""
    if dist.is_initialized():
        dist.destroy_process_group()
