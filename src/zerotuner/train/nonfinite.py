"""Non-finite steps: skipped the way dynamic loss scaling skips an overflow, and bounded.

A step whose loss or gradient norm is inf or NaN (divergence, an fp16 overflow) leaves the
weights, the optimizer state and the learning-rate schedule as they were. It still counts as a
step (its batches are used up; ZT_MAX_STEPS includes it), is marked `"skipped": true` in
OUTPUT/run/steps.jsonl, logged, and counted in `zerotuner_nonfinite_steps_total`.
`ZT_MAX_NONFINITE_STEPS` skipped steps in a row stop the run with exit 4 (errors.Diverged):
no checkpoint is committed at a skipped step, nothing is exported, the last committed
checkpoint stays.

Who skips, read in DeepSpeed 0.19's source:
- ZeRO-1/2 (`stage_1_and_2.py` step), ZeRO-3 (`stage3.py` step), the bf16 optimizer
  (`bf16_optimizer.py`) and the 16-bit ZeRO-0 optimizer (`fp16/fused_optimizer.py`) already
  discard a step whose reduced gradient norm is invalid, CPU offload included: they zero the
  gradients, set `optimizer.overflow`, and the engine then leaves the LR scheduler alone and
  counts `engine.skipped_steps` (bf16 at ZeRO-1/2 through `bf16.check_grad_overflow`, true by
  default). That check is one host sync inside DeepSpeed's step, there today.
- ZeRO-0 in fp32 steps a plain torch optimizer that nobody checks: `PlainStepGuard` wraps its
  `step` to skip the same way, reading the norm together with the step's loss (the step's
  one device sync, moved there from loop.step_scalars).
- Every check above sees gradients only, and a loss is one rank's: `poison` gives a
  non-finite loss NaN gradients, so the reduced norm carries it and every rank decides alike.
- fp16: DeepSpeed's loss scaler skips overflowing steps while it searches for a scale; those
  do not count towards the limit. When the scale reaches its minimum and still overflows,
  DeepSpeed gives up, and that becomes exit 4 too (loop.train).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import Diverged
from zerotuner.launch.distributed import collective_device
from zerotuner.launch.records import StepRecord
from zerotuner.settings.schema import env_name

log = logging.getLogger(__name__)

LOGGED_ONE_BY_ONE = 20  # skipped steps logged one line each; after that, every 100th


def poison(loss: torch.Tensor) -> torch.Tensor:
    """`loss` itself (times exactly 1) when finite; else a loss whose gradients are all NaN.

    A non-finite loss can have finite gradients (an overflowed square), and only gradients
    reach the skip checks. On device: no sync."""
    return loss * torch.where(torch.isfinite(loss), 1.0, math.nan).detach()


class PlainStepGuard:
    """ZeRO-0 in fp32: skip the plain optimizer's step when the gradient norm is non-finite.

    Sets `optimizer.overflow` as DeepSpeed's own optimizers do, so the engine skips the LR
    scheduler and counts `skipped_steps`; the gradients are zeroed by the engine after the
    step either way. The norm is speed.foreach_clip's when it clipped this step, else its own
    foreach norm (which also gives steps.jsonl a norm without clipping). `loss`: the step's
    mean loss, set by the loop before the boundary step, read with the norm in one transfer;
    `scalars` hands both to loop.step_scalars."""

    def __init__(self, engine: Any) -> None:
        self.optimizer = engine.optimizer
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.loss: torch.Tensor | None = None
        self.scalars: tuple[float, float] | None = None
        self._step = self.optimizer.step
        self.optimizer.overflow = False
        self.optimizer.step = self.step

    def step(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self.optimizer
        norm = optimizer.__dict__.pop("step_norm", None)  # speed.foreach_clip's, this step
        if norm is None:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        optimizer._global_grad_norm = norm  # what engine.get_global_grad_norm() returns
        if self.loss is None:  # stepped outside loop.train
            finite = math.isfinite(float(norm))
        else:  # the step's one device sync
            pair = torch.stack([self.loss.float().reshape(()).to(norm.device), norm.float()])
            loss, norm_value = pair.tolist()
            self.loss, self.scalars = None, (loss, norm_value)
            finite = math.isfinite(norm_value)
        optimizer.overflow = not finite
        return self._step(*args, **kwargs) if finite else None


def guard_plain_optimizer(engine: Any) -> PlainStepGuard | None:
    """The guard where DeepSpeed has no skip of its own (ZeRO-0 in fp32), else None."""
    if engine.zero_optimization_stage() != 0 or engine.fp16_enabled() or engine.bfloat16_enabled():
        return None
    return PlainStepGuard(engine)


def weights_finite(module: Any) -> bool:
    """Whether every trained weight is finite, on every rank (a collective). Each rank checks
    what it holds (at ZeRO-3 its partition); one isfinite per tensor, one sync: run before
    committing, sampling or exporting, never per step."""
    import torch.distributed as dist

    tensors = [getattr(p, "ds_tensor", p) for p in module.parameters() if p.requires_grad]
    tensors = [t for t in tensors if t.numel() and t.device.type != "meta"]
    device = tensors[0].device if tensors else torch.device("cpu")
    flags = [torch.isfinite(t).all().to(device) for t in tensors]
    flags = flags or [torch.tensor(True, device=device)]
    finite = torch.stack(flags).all().to(torch.int32)
    if dist.is_available() and dist.is_initialized():
        finite = finite.to(collective_device())
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def _value(x: float | None) -> str:
    return "none" if x is None else f"{x:.4g}"


class Streak:
    """Counts skipped steps, logs them (rank 0) and raises Diverged after `limit` in a row.

    Every rank sees the same `skipped` (decided on the reduced gradient norm), so every rank
    raises at the same step. `last_checkpoint` names what a user can resume from."""

    def __init__(
        self,
        limit: int,
        *,
        rank: int,
        counts: bool,
        last_checkpoint: Callable[[], Path | None],
    ) -> None:
        self.limit, self.rank, self.counts = limit, rank, counts
        self.last_checkpoint = last_checkpoint
        self.in_a_row = 0
        self.total = 0
        self.steps = 0
        self.first_in_row: int | None = None

    def update(self, record: StepRecord) -> None:
        self.steps += 1
        if not record.skipped:
            self.in_a_row, self.first_in_row = 0, None
            return
        self.total += 1
        if self.counts:  # fp16: the loss scaler's own skips never count (module docstring)
            self.in_a_row += 1
            self.first_in_row = self.first_in_row or record.step
        if self.rank == 0 and (self.total <= LOGGED_ONE_BY_ONE or self.total % 100 == 0):
            log.warning(
                "step %d skipped: loss %s, grad norm %s (non-finite; weights unchanged); "
                "%d in a row (limit %d), %d skipped so far",
                record.step, _value(record.loss), _value(record.grad_norm), self.in_a_row,
                self.limit, self.total,
            )  # fmt: skip
        if self.counts and self.in_a_row >= self.limit:
            raise Diverged(self.message(record))

    def message(self, record: StepRecord) -> str:
        steps = f"steps {self.first_in_row}-{record.step}" if self.in_a_row > 1 else "step"
        return (
            f"training diverged: {steps} had a non-finite loss or gradient norm, "
            f"{self.in_a_row} in a row ({env_name('max_nonfinite_steps')}={self.limit}); at step "
            f"{record.step} loss {_value(record.loss)}, grad norm {_value(record.grad_norm)}. "
            f"Skipped steps left the weights unchanged; nothing was exported. "
            f"{resume_hint(self.last_checkpoint())}"
        )

    def summary(self) -> None:
        if self.rank == 0 and self.total:
            log.warning(
                "%d of %d steps were skipped as non-finite (weights unchanged at each)",
                self.total, self.steps,
            )  # fmt: skip


def resume_hint(checkpoint: Path | None) -> str:
    """Where a user picks up after a divergence, and what to change first (one sentence)."""
    fix = (
        f"lower {env_name('learning_rate')} or change {env_name('mixed_precision')} before "
        "retrying (a retry as it is diverges again)"
    )
    if checkpoint is None:
        return f"No checkpoint was committed: {fix}."
    return f"Last committed checkpoint: {checkpoint} ({env_name('resume')}=auto resumes it); {fix}."
