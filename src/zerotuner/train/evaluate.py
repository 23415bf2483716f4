"""The held-out loss (ZT_EVAL_DATA_DIR or ZT_EVAL_FRACTION) and the early stop it drives.

Each held-out image is evaluated alone, from its cached latents, with a generator seeded by
the run's seed and the image's identity: its noise, timestep and flip are the same at every
evaluation, whatever the world size, the batch or a resume. The images are shared round-robin
over the ranks; each rank writes its losses into a vector of all of them (zero elsewhere) and
one all-reduce sums the vectors: each slot has one non-zero addend, so every rank holds the
same exact losses and sums them in the same order. At ZeRO-3 a forward gathers parameters
collectively, so every rank runs as many forwards: a rank with one image fewer evaluates one
of its own again, its loss weighted 0 (not written).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from zerotuner.launch.distributed import collective_device


def sample_generator(seed: int, identity: str) -> torch.Generator:
    """A CPU generator of one held-out image's own: the same draws at every evaluation."""
    digest = hashlib.sha256(f"{seed}|{identity}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF)


def held_out_loss(
    module: Any,
    identities: Sequence[str],
    *,
    seed: int,
    rank: int,
    world: int,
    loss_of: Callable[[int, torch.Generator], torch.Tensor],
) -> float:
    """The mean loss over the held-out images, the same on every rank (a collective: call it
    on all). `loss_of(i, generator)`: image i's loss (its own micro-batch) under `module`,
    which is put in eval mode for the call and under no_grad."""
    count = len(identities)
    mine = list(range(rank, count, world))
    turns = -(-count // world)  # every rank's forwards: the most any rank has
    losses = torch.zeros(count, dtype=torch.float64)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for turn in range(turns):
                counted = turn < len(mine)
                slot = mine[turn] if counted else (mine[0] if mine else 0)  # padding: weight 0
                loss = loss_of(slot, sample_generator(seed, identities[slot]))
                if counted:
                    losses[slot] = loss.detach().double().cpu()
    finally:
        module.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reduced = losses.to(collective_device())
        torch.distributed.all_reduce(reduced)
        losses = reduced.cpu()
    return float(losses.sum().item() / count)


@dataclass
class EarlyStop:
    """The best held-out loss so far and how many evaluations since it (ZT_EARLY_STOP_*);
    saved in each checkpoint's manifest (`state`), so a resume goes on counting."""

    patience: int  # 0: never stops, still tracks the best
    min_delta: float
    best_step: int | None = None
    best_loss: float | None = None
    since_best: int = 0  # evaluations without an improvement by more than min_delta
    evaluations: int = 0
    last_step: int | None = None
    last_loss: float | None = None

    def update(self, step: int, loss: float) -> bool:
        """Record an evaluation; True when it is the new best."""
        self.evaluations += 1
        self.last_step, self.last_loss = step, loss
        if self.best_loss is None or loss < self.best_loss - self.min_delta:
            self.best_step, self.best_loss, self.since_best = step, loss, 0
            return True
        self.since_best += 1
        return False

    @property
    def exhausted(self) -> bool:
        return bool(self.patience) and self.since_best >= self.patience

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("patience", "min_delta")}

    def restore(self, state: dict[str, Any] | None) -> None:
        for key, value in (state or {}).items():
            if key in self.state():
                setattr(self, key, value)

    def why(self, step: int) -> str:
        """The one line an early stop ends the run with."""
        return (
            f"stopped early at step {step}: the held-out loss has not improved by more than "
            f"{self.min_delta:g} in {self.since_best} evaluations; exported the best, step "
            f"{self.best_step} (held-out loss {self.best_loss:.6g})"
        )


class EarlyStopped(Exception):
    """The held-out loss stopped improving (ZT_EARLY_STOP_PATIENCE); `step` is committed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"early stop at step {step}")
        self.step = step
