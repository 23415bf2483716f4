"""The training loop in named steps: train() -> train_step() -> forward_backward().

It sees a DeepSpeed engine (whatever ZeRO stage and offload), cached batches, the family's
conditioning and its objective; nothing here depends on the model family. Noise and timesteps
come from a generator seeded by (seed, step, micro-batch, rank), so a resumed run draws exactly
what the uninterrupted run would have drawn, with no RNG state to carry in checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.errors import Diverged
from zerotuner.launch.records import Sink, StepRecord
from zerotuner.train.nonfinite import PlainStepGuard, Streak, poison, resume_hint


def step_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """A CPU generator unique to one micro-batch of one rank, reproducible on resume."""
    return torch.Generator().manual_seed(hash((seed, step, micro, rank)) & 0x7FFF_FFFF_FFFF_FFFF)


@dataclass
class LoopContext:
    """What the loop needs besides the engine; built once per run (zerotuner.train.run)."""

    conditioning: Any  # the family (base.ModelFamily): model_kwargs from a batch
    objective: Any  # base.Objective: the family's loss
    dtype: torch.dtype
    seed: int
    rank: int
    accumulation: int
    samples_per_step: int  # micro-batch * accumulation * world size
    load_batch: Callable[[Any, torch.Generator], dict[str, torch.Tensor]]
    guard: PlainStepGuard | None = None  # ZeRO-0 fp32: the skip DeepSpeed lacks there
    streak: Streak | None = None  # non-finite steps in a row: exit 4 past the limit
    # the held-out loss after a step, when one is due (train.evaluate): its sinks hear it
    # (on_eval) before the step's record
    evaluate: Callable[[int], None] | None = None


def forward_backward(
    engine: Any, batch: dict[str, torch.Tensor], ctx: LoopContext, gen: torch.Generator
) -> Any:
    """One micro-batch: loss, then engine.backward (DeepSpeed scales for accumulation). A
    non-finite loss gets NaN gradients, so the step is skipped on every rank (nonfinite)."""
    loss = batch_loss(engine, batch, ctx, gen)
    engine.backward(poison(loss))
    return loss.detach()


def batch_loss(
    engine: Any, batch: dict[str, torch.Tensor], ctx: LoopContext, gen: torch.Generator
) -> torch.Tensor:
    """The objective's loss of one cached batch (noise and timesteps from `gen`): what a step
    trains on and what the held-out evaluation (train.evaluate) measures."""
    kwargs = ctx.conditioning.model_kwargs(batch, ctx.dtype)
    return ctx.objective.loss(
        engine, batch["latents"], kwargs, generator=gen, dtype=ctx.dtype, mask=batch.get("mask")
    )


def train_step(engine: Any, micro_batches: list[Any], step: int, ctx: LoopContext) -> torch.Tensor:
    """One optimizer step: `accumulation` micro-batches. Returns the mean loss (on device)."""
    losses = []
    for micro, keys in enumerate(micro_batches):
        gen = step_generator(ctx.seed, step, micro, ctx.rank)
        batch = ctx.load_batch(keys, gen)
        losses.append(forward_backward(engine, batch, ctx, gen))
        if micro == len(micro_batches) - 1:
            mean = torch.stack(losses).mean()
            if ctx.guard is not None:
                ctx.guard.loss = mean  # read with the norm the skip decides on, in one sync
        engine.step()  # steps the optimizer and LR only at the accumulation boundary
    return mean


def step_scalars(
    loss: torch.Tensor, engine: Any, guard: PlainStepGuard | None = None
) -> tuple[float, float | None]:
    """The step's mean loss and gradient norm, copied to the host together: the step's one
    device sync (what steps.jsonl and the sinks need). At ZeRO-0 in fp32 the guard already
    made it, to decide the skip."""
    if guard is not None and guard.scalars is not None:
        scalars, guard.scalars = guard.scalars, None
        return scalars
    norm = engine.get_global_grad_norm()
    if not isinstance(norm, torch.Tensor):
        return loss.item(), None if norm is None else float(norm)
    both = torch.stack(
        [loss.detach().float().reshape(()), norm.float().reshape(()).to(loss.device)]
    )
    value, norm_value = both.tolist()
    return value, norm_value


def train(
    engine: Any,
    steps: Iterator[tuple[int, list[Any]]],
    ctx: LoopContext,
    *,
    sinks: list[Sink],
    after_step: Callable[[StepRecord], None],
) -> int:
    """Run optimizer steps from `steps` ((step number, its micro-batches) pairs, already
    positioned for a resume); `after_step` runs EMA, checkpoints, samples and stop checks.
    Returns the last finished step. Raises Diverged (exit 4) when `ctx.streak` says so."""
    last = 0
    started = time.perf_counter()
    for step, micro_batches in steps:
        lr = float(engine.get_lr()[0])  # the rate this step uses; the scheduler moves at its end
        skipped_before = engine.skipped_steps  # DeepSpeed counts the steps it discards
        try:
            mean = train_step(engine, micro_batches, step, ctx)
        except Exception as error:
            if LOSS_SCALE_FLOOR not in str(error):
                raise
            raise Diverged(
                f"training diverged: fp16 gradients still overflowed at step {step} with "
                f"DeepSpeed's minimum loss scale. {_resume_hint(ctx)}"
            ) from None
        loss, norm = step_scalars(mean, engine, ctx.guard)
        seconds = time.perf_counter() - started
        if ctx.evaluate is not None:
            ctx.evaluate(step)
        record = StepRecord(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=norm,
            step_seconds=seconds,
            samples=ctx.samples_per_step,
            timestamp=time.time(),
            skipped=engine.skipped_steps > skipped_before,
        )
        for sink in sinks:
            sink.on_step(record)
        if ctx.streak is not None:
            ctx.streak.update(record)  # raises Diverged after too many skipped in a row
        last = step
        after_step(record)
        started = time.perf_counter()
    return last


# DeepSpeed's fp16 loss scaler raises a plain Exception saying so (fp16/loss_scaler.py).
LOSS_SCALE_FLOOR = "loss scale already at minimum"


def _resume_hint(ctx: LoopContext) -> str:
    return resume_hint(ctx.streak.last_checkpoint() if ctx.streak else None)
