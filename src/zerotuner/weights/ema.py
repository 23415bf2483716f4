"""An exponential moving average of the trained weights, kept on the CPU in fp32 on rank 0:
the whole UNet in full training, the adapter only in a LoRA run (the frozen base never moves).

DeepSpeed does not shard it (the seed's note: an EMA doubles the footprint), so it lives in
host memory of one rank. Under ZeRO-3 each rank holds only a shard of every parameter: all
ranks gather one parameter group at a time (`GatheredParameters`), rank 0 updates the
average. Under ZeRO 0-2 every rank holds full (possibly 16-bit) weights after the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

GATHER_GROUP = 64  # parameters gathered at once under ZeRO-3: bounds the peak memory


@contextmanager
def full_parameters(
    module: torch.nn.Module, params: list[torch.nn.Parameter], *, modifier_rank: int | None = None
) -> Iterator[None]:
    """Make `params` whole on every rank for the duration (a no-op below ZeRO-3); with
    `modifier_rank`, that rank's changes are kept (re-partitioned) on exit.

    Every rank must enter it: the gather is a collective.
    """
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield
    else:
        yield


def iter_full_named_parameters(
    module: torch.nn.Module, *, trainable_only: bool = False
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) with the parameter whole while the caller looks at it, at any stage
    (`trainable_only`: the parameters that require grad, gathering no frozen one)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable_only]
    for start in range(0, len(named), GATHER_GROUP):
        group = named[start : start + GATHER_GROUP]
        with full_parameters(module, [p for _, p in group]):
            yield from group


def full_state_dict(module: torch.nn.Module, *, rank: int) -> dict[str, torch.Tensor] | None:
    """An fp32 CPU copy of every parameter and persistent buffer on rank 0 (None elsewhere);
    every rank must call it. Used for samples and the final export.

    With mixed precision the optimizer's fp32 master weights are taken (DeepSpeed's
    `safe_get_full_fp32_param`, a collective at ZeRO 1-3), not the bf16/fp16 copies the
    forward pass uses, so the export equals what zero_to_fp32 makes of the checkpoint.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    state: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    z3 = getattr(named[0][1], "_z3_optimizer", None) if named else None
    if z3 is not None and getattr(z3, "swap_optimizer", False):
        masters = _swapped_zero3_masters(z3, [p for _, p in named])
    else:
        masters = [safe_get_full_fp32_param(p) for _, p in named]
    found = [m for m in masters if m is not None]
    if named and len(found) == len(masters):
        if state is not None:
            state.update(
                {
                    n: m.detach().float().cpu().clone()
                    for (n, _), m in zip(named, found, strict=True)
                }
            )
        # a part the family leaves frozen (LTX-2's audio stream): as the module holds it
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        for start in range(0, len(frozen), GATHER_GROUP):
            group = frozen[start : start + GATHER_GROUP]
            with full_parameters(module, [p for _, p in group]):
                if state is not None:
                    state.update({n: p.detach().float().cpu().clone() for n, p in group})
    else:  # no optimizer mapping (ZeRO-0 in fp32): the module holds the weights
        for name, param in iter_full_named_parameters(module):
            if state is not None:
                state[name] = param.detach().float().cpu().clone()
    if state is not None:  # the persistent buffers, as state_dict (Chroma has another kind)
        for owner, sub in module.named_modules():
            for name, buffer in sub.named_buffers(recurse=False):
                if name not in sub._non_persistent_buffers_set:
                    key = f"{owner}.{name}" if owner else name
                    state[key] = buffer.detach().float().cpu().clone()
    return state


def trainable_state_dict(module: torch.nn.Module, *, rank: int) -> dict[str, torch.Tensor] | None:
    """The parameters that require grad (a LoRA adapter), whole and fp32 on the CPU, on rank 0
    (None elsewhere), keyed by the module's parameter names. A collective: every rank calls it.

    With mixed precision the optimizer's fp32 masters are taken (safe_get_full_fp32_param,
    which gathers them at ZeRO 1-3); without an optimizer mapping (ZeRO-0 in fp32) the
    module's own weights, gathered first where they are partitioned."""
    from deepspeed.utils import safe_get_full_fp32_param

    state: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        master = safe_get_full_fp32_param(param)
        if master is None:
            with full_parameters(module, [param]):
                master = param.detach().float().cpu().clone()
        if state is not None:
            state[name] = master.detach().float().cpu().clone()
    return state


def _swapped_zero3_masters(z3: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """The full fp32 masters under ZeRO-3 with the optimizer on NVMe, one sub-group at a time.

    safe_get_full_fp32_param swaps a parameter's whole optimizer sub-group (master and both
    Adam moments) in from NVMe for every single tensor: for a 95M-parameter UNet that read
    ~400 GB. Here each sub-group is read once and all its parameters are gathered from it.
    Uses ZeRO-3 internals (DeepSpeed 0.19): the optimizer's own per-parameter path, grouped.
    """
    index = {id(p): i for i, p in enumerate(params)}
    masters: list[torch.Tensor | None] = [None] * len(params)
    for group_id, group in enumerate(z3.fp16_groups):
        swapped = z3._swappable_optimizer_subgroup(group_id)
        if swapped:
            z3._optimizer_states_and_gradient_swap_in(group_id)
        flat = z3.fp32_partitioned_groups_flat[group_id]
        for param in group:
            _, offset, count = z3.grad_position[z3.get_param_id(param)]
            full = z3._fp32_state_allgather(param, flat.narrow(0, offset, count))
            if id(param) in index:
                masters[index[id(param)]] = full
        if swapped:
            z3._release_swap_buffers(group_id)
    return masters


class EMA:
    """Shadow weights; `decay` is capped by (1 + n) / (10 + n) after n updates (as diffusers'
    EMAModel does), so short runs are not dominated by the initial weights. `trainable_only`
    (LoRA): only the parameters that require grad are averaged, the frozen base is not copied."""

    def __init__(
        self, module: torch.nn.Module, *, decay: float, rank: int, trainable_only: bool = False
    ) -> None:
        self.decay, self.rank, self.updates = decay, rank, 0
        self.trainable_only = trainable_only
        if trainable_only:
            state = trainable_state_dict(module, rank=rank)
        else:
            state = full_state_dict(module, rank=rank)
        self.shadow = {k: v for k, v in state.items()} if state is not None else None

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """Call on every rank after each optimizer step."""
        decay = self.current_decay()
        self.updates += 1
        for name, param in iter_full_named_parameters(module, trainable_only=self.trainable_only):
            if self.shadow is not None:
                shadow = self.shadow[name]
                # sync: a device-to-host copy of every weight each step (the EMA is on the CPU)
                shadow.lerp_(param.detach().float().cpu(), 1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        assert self.shadow is not None, "EMA weights live on rank 0"
        return self.shadow

    def load(self, shadow: dict[str, torch.Tensor], updates: int) -> None:
        self.updates = updates
        if self.shadow is not None:
            for name, value in shadow.items():
                self.shadow[name].copy_(value)
