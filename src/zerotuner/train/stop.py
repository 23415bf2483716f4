"""Stopping on SIGTERM/SIGINT: every rank agrees at the same step boundary, or none stops.

torchrun forwards the signal to each rank at about the same time, but each rank handles it
between two bytecodes of its own. The ranks therefore decide together, over an all-reduce of
the flag at each step boundary, and only on its reduced value.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch


class Stopped(Exception):
    """The ranks agreed to stop on a signal and committed a checkpoint at `step` (None: they
    stopped before training, with nothing new to save)."""

    def __init__(self, step: int | None, signal_name: str) -> None:
        done = f"after committing checkpoint step-{step}" if step else "before training"
        super().__init__(f"stopped by {signal_name} {done}")
        self.step = step


class StopRequest:
    """SIGTERM/SIGINT ask every rank to stop at the next step boundary, after a committed
    checkpoint (or, when it comes during download or caching, once caching ends, with nothing
    to save); a second signal ends the process at once (the last committed checkpoint is
    never touched by a half save). Ranks agree over a gloo group (also beside NCCL)."""

    def __init__(self, timeout_seconds: float | None = None) -> None:
        import datetime

        import torch.distributed as dist

        self.signum: int | None = None
        # the job's collective timeout, not new_group's own default (30 min for gloo)
        timeout = datetime.timedelta(seconds=timeout_seconds) if timeout_seconds else None
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        if threading.current_thread() is threading.main_thread():  # else the launcher's job
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, signal.SIG_DFL)  # a second one: the default action, exit now

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "signal"

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        # Decide on the reduced value only: a signal handled after the all_reduce returned
        # must wait for the next step, or this rank stops while its peers train on.
        agreed = int(flag.item())  # sync: one int per step
        if agreed:
            self.signum = agreed
        return bool(agreed)
