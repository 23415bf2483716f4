"""Client optimizers: the ones DeepSpeed does not build from its config, built here and handed
to `deepspeed.initialize(optimizer=...)`.

The normalized DeepSpeed config names them in its `optimizer` section (type and params, as
`zerotuner config --explain` shows); `take` removes that section, which DeepSpeed would try to
build itself, and builds the optimizer over the trainable parameters. DeepSpeed then wraps it:
at ZeRO >= 1 it steps one flat fp32 partition per parameter group on each rank, which changes
what two of them compute (read in DeepSpeed 0.19's stage_1_and_2.py and stage3.py):

- Prodigy estimates its step size d from sums over every parameter: each rank sees only its
  shard, so `ShardedProdigy` sums the two partial sums over the ranks before dividing.
- Schedule-free AdamW trains on one sequence of weights (y) and evaluates another (x): samples,
  checkpoints and the export take x (`eval_weights`), which must then reach the module that
  DeepSpeed keeps beside its fp32 partitions.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prodigyopt import Prodigy

from zerotuner.errors import ConfigError
from zerotuner.weights import checkpoint

log = logging.getLogger("zerotuner.train.worker")


class ShardedProdigy(Prodigy):
    """prodigyopt 1.1.2's Prodigy step, with its d-estimate summed over the data-parallel ranks.

    prodigyopt's own sharded mode (`fsdp_in_use`) all-reduces a tensor it puts on CUDA
    (`torch.zeros(2).cuda()`), which a CPU rank (gloo) cannot run, and leaves d a tensor. Here
    the two partial sums (the numerator's increment and the denominator) are reduced on
    `reduce_device` (NCCL: the GPU, gloo: the CPU) and d stays a float in the param groups, so a
    checkpoint holds it as prodigyopt's own does. Every rank reduces, even one without
    gradients, so none waits alone. Otherwise line for line the published algorithm.
    """

    def __init__(self, params: Any, *, reduce_device: torch.device | None, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.reduce_device = reduce_device  # None: not sharded (ZeRO-0, one rank)

    def _sum_over_ranks(self, numerator: float, denominator: float) -> tuple[float, float]:
        if self.reduce_device is None or not dist.is_initialized():
            return numerator, denominator
        both = torch.tensor([numerator, denominator], dtype=torch.float64)
        both = both.to(self.reduce_device)
        dist.all_reduce(both)
        total = both.tolist()  # host sync: d is a float the step below multiplies with
        return total[0], total[1]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        use_bias_correction = group["use_bias_correction"]
        beta1, beta2 = group["betas"]
        beta3 = group["beta3"] if group["beta3"] is not None else math.sqrt(beta2)
        k = group["k"]
        d, d_max, d_coef = group["d"], group["d_max"], group["d_coef"]
        lr = max(g["lr"] for g in self.param_groups)
        bias_correction = (
            ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if use_bias_correction else 1
        )
        dlr = d * lr * bias_correction
        growth_rate, decouple = group["growth_rate"], group["decouple"]
        d_numerator = group["d_numerator"] * beta3
        delta_numerator, d_denom = 0.0, 0.0

        for group in self.param_groups:
            decay, group_lr, d0 = group["weight_decay"], group["lr"], group["d0"]
            slice_p = group["slice_p"]
            if group_lr not in [lr, 0.0]:
                raise RuntimeError("Prodigy: parameter groups differ in lr other than 0")
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if decay != 0 and not decouple:
                    grad.add_(p, alpha=decay)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["s"] = torch.zeros_like(p.flatten()[::slice_p])
                    state["p0"] = (
                        p.flatten()[::slice_p].clone()
                        if p.any()
                        else torch.tensor(0, device=p.device, dtype=p.dtype)
                    )
                    if beta1 > 0:
                        state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if group_lr > 0.0:
                    sliced = grad.flatten()[::slice_p]
                    s, p0 = state["s"], state["p0"]
                    delta_numerator += (
                        (d / d0) * dlr * torch.dot(sliced, p0 - p.flatten()[::slice_p]).item()
                    )
                    if beta1 > 0:
                        state["exp_avg"].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                    scale = (d / d0) * (d if group["safeguard_warmup"] else dlr)
                    s.mul_(beta3).add_(sliced, alpha=scale)
                    d_denom += s.abs().sum().item()

        # the sums over every parameter, where a rank holds a shard of them
        delta_numerator, d_denom = self._sum_over_ranks(delta_numerator, d_denom)
        if d_denom == 0:  # no gradient anywhere yet: nothing to estimate from
            return loss
        global_d_numerator = d_numerator + delta_numerator
        d_hat = d
        if lr > 0.0:
            d_hat = d_coef * global_d_numerator / d_denom
            if d == group["d0"]:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * growth_rate)

        for group in self.param_groups:
            group.update(
                d_numerator=global_d_numerator, d_denom=d_denom, d=d, d_max=d_max, d_hat=d_hat
            )
            decay, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                denom = state["exp_avg_sq"].sqrt().add_(d * eps)
                if decay != 0 and decouple:
                    p.add_(p, alpha=-decay * dlr)
                if beta1 > 0:
                    p.addcdiv_(state["exp_avg"], denom, value=-dlr)
                else:
                    p.addcdiv_(p.grad, denom, value=-dlr * d)
            group["k"] = k + 1
        return loss


def _prodigy(params: list[Any], p: dict[str, Any], sharded: bool) -> Any:
    from zerotuner.launch.distributed import collective_device

    return ShardedProdigy(
        params, reduce_device=collective_device() if sharded else None, lr=p["lr"],
        betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"],
        d_coef=p["d_coef"], safeguard_warmup=p["safeguard_warmup"],
        use_bias_correction=p["use_bias_correction"], decouple=True,
    )  # fmt: skip


def _schedulefree(params: list[Any], p: dict[str, Any], sharded: bool) -> Any:
    from schedulefree import AdamWScheduleFree

    optimizer = AdamWScheduleFree(
        params, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
        weight_decay=p["weight_decay"], warmup_steps=p["warmup_steps"],
    )  # fmt: skip
    # It starts in eval mode, where a step raises. Not optimizer.train(): that touches
    # self.state[p] for each parameter, leaving keys DeepSpeed's flat partitions replace.
    for group in optimizer.param_groups:
        group["train_mode"] = True
    return optimizer


def _adamw8bit(params: list[Any], p: dict[str, Any], sharded: bool) -> Any:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(
        params, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"]
    )


def _adafactor(params: list[Any], p: dict[str, Any], sharded: bool) -> Any:
    from transformers.optimization import Adafactor

    # a set learning rate (the fine-tuning recipe), not Adafactor's own relative step size
    return Adafactor(
        params, lr=p["lr"], weight_decay=p["weight_decay"], clip_threshold=p["clip_threshold"],
        decay_rate=p["decay_rate"], scale_parameter=False, relative_step=False,
        warmup_init=False,
    )  # fmt: skip


# ZT_OPTIMIZER's client names (as normalize writes optimizer.type) -> how each is built.
BUILDERS: dict[str, Callable[[list[Any], dict[str, Any], bool], Any]] = {
    "prodigy": _prodigy,
    "adamw_schedulefree": _schedulefree,
    "adamw8bit": _adamw8bit,
    "adafactor": _adafactor,
}


def take(config: dict[str, Any], params: list[Any], *, zero_stage: int) -> Any | None:
    """The client optimizer `config` names, built over `params`, its section removed from
    `config` (DeepSpeed would try to build that type itself); None for DeepSpeed's own."""
    section = config.get("optimizer") or {}
    kind = section.get("type")
    if kind not in BUILDERS:
        return None
    del config["optimizer"]
    sharded = zero_stage >= 1  # each rank steps its own shard of the trainable parameters
    optimizer = BUILDERS[kind](params, dict(section.get("params", {})), sharded)
    log.info(
        "optimizer: %s (%s, client optimizer: DeepSpeed %s)",
        kind, type(optimizer).__name__,
        f"steps one shard of it per rank (ZeRO-{zero_stage})" if sharded else "wraps it whole",
    )  # fmt: skip
    return optimizer


def check_resume(path: Path, kind: str, *, world: int, zero_stage: int) -> None:
    """A checkpoint with a client optimizer's state resumes with that optimizer, and DeepSpeed's
    own way only: the universal checkpoint that carries a run to another world size or stage
    knows Adam's moments, not Prodigy's, schedule-free's, 8-bit or Adafactor states."""
    manifest = checkpoint.read_manifest(path) or {}
    saved = manifest.get("optimizer")  # absent in checkpoints older than client optimizers
    if saved is None or (saved not in BUILDERS and kind not in BUILDERS):
        return
    if saved != kind:
        raise ConfigError(
            f"ZT_RESUME: {path} holds {saved}'s optimizer state; ZT_OPTIMIZER={kind} cannot "
            f"continue it: set ZT_OPTIMIZER={saved}, or start a new run"
        )
    if not checkpoint.same_layout(manifest, stage=zero_stage, world=world):
        raise ConfigError(
            f"ZT_RESUME: {path} was saved at ZeRO-{manifest.get('zero_stage')} on "
            f"{manifest.get('world_size')} rank(s); {kind}'s state resumes only on that layout "
            f"(ZeRO-1 and 2 share one), not ZeRO-{zero_stage} on {world}: the universal "
            "checkpoint carries Adam's moments only"
        )


def _base(engine: Any) -> Any:
    return getattr(engine, "basic_optimizer", None) or engine.optimizer


def _sync_module(engine: Any) -> None:
    """The fp32 weights the optimizer steps -> the module's weights (every rank), as DeepSpeed
    does after a step: ZeRO-1/2 and the bf16 optimizer copy their partitions back and gather
    them; an unwrapped ZeRO-0 optimizer steps the module's own weights."""
    update = getattr(engine.optimizer, "update_lp_params", None)
    if update is not None:
        update()


@contextlib.contextmanager
def eval_weights(engine: Any, why: str) -> Iterator[None]:
    """Schedule-free's evaluation weights (x) in the module and its fp32 masters for the block,
    its training weights (y) again after it; other optimizers: nothing changes."""
    base = _base(engine)
    if not hasattr(base, "eval") or "train_mode" not in base.param_groups[0]:
        yield
        return
    base.eval()
    _sync_module(engine)
    log.debug("schedule-free: evaluation weights for %s", why)
    try:
        yield
    finally:
        base.train()
        _sync_module(engine)


def resume_training_weights(engine: Any) -> None:
    """A checkpoint of a schedule-free run holds its evaluation weights (saved in eval mode):
    back to the training weights, as the uninterrupted run did right after saving."""
    base = _base(engine)
    if hasattr(base, "train") and base.param_groups[0].get("train_mode") is False:
        base.train()
        _sync_module(engine)
