"""Resume a committed checkpoint on another world size or ZeRO stage.

DeepSpeed loads a checkpoint only into the layout that saved it, and its own universal
checkpoint (`ds_to_universal` + `load_universal`) stops at the stage 1/2 <-> 3 border and at
stage 0. So the bridge is ours, in two halves:

- `convert` (rank 0, once): the checkpoint becomes one folder per parameter with its fp32
  weight and Adam moments (`universal/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`, DeepSpeed's
  universal layout, written by `ds_to_universal` for ZeRO 1-3 checkpoints and by us for ZeRO-0
  ones, whose optimizer state is a plain torch state dict), plus `common.pt` (LR schedule,
  step counters). Built in a temp folder and renamed into place: a crash leaves no half cache.
- `load_into` (every rank): each parameter's weight goes into the module and the fp32 master,
  its moments into the optimizer (DeepSpeed's safe_set_full_* at ZeRO 1-3, the torch state at
  ZeRO-0), then the optimizer step count, LR schedule and engine counters.

Everything carries over: weights, fp32 masters, both Adam moments, the step count (Adam's bias
correction), the LR schedule, also into a ZeRO-3 run whose optimizer lives on NVMe. Not
carried: an fp16 loss scale (it re-warms) and ZeRO-0 fp16 checkpoints (FP16_Optimizer's
layout): refused with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal, overload

import torch

from zerotuner.errors import ConfigError

log = logging.getLogger(__name__)

FOLDER = "universal"
COMMON = "common.pt"
DONE = "complete"
MOMENTS = ("exp_avg", "exp_avg_sq")
SWAPPED = "offloaded_tensors"  # DeepSpeed's copy of an NVMe-offloaded optimizer's swap files
GROUP = 64  # parameters set at once (ZeRO-3 gathers them): bounds the peak memory


def _model_states(path: Path) -> dict[str, Any]:
    """The engine-wide state every DeepSpeed checkpoint keeps beside the module."""
    files = sorted(path.glob("*model_states.pt"))
    if not files:
        raise ConfigError(f"ZT_RESUME: {path} has no DeepSpeed model states file")
    return torch.load(files[0], map_location="cpu", weights_only=False)


def convert(path: Path, names: list[str]) -> Path:
    """`path/universal`, built once (call on one rank). `names`: the trainable parameters in
    the optimizer's order (needed for ZeRO-0 checkpoints, whose state is keyed by index)."""
    target = path / FOLDER
    if (target / DONE).is_file():
        return target
    tmp = path / f".{FOLDER}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    states = _model_states(path)
    if any(path.glob("*optim_states.pt")):
        _ds_to_universal(path, tmp)
    else:
        _from_torch_optimizer(states, names, tmp)
    common = {
        "lr_scheduler": states.get("lr_scheduler"),
        "global_steps": int(states.get("global_steps", 0)),
        "global_samples": int(states.get("global_samples", 0)),
        "skipped_steps": int(states.get("skipped_steps", 0)),
    }
    torch.save(common, tmp / COMMON)
    (tmp / DONE).write_text("ok\n")
    os.replace(tmp, target)
    return target


def _ds_to_universal(path: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    source = path
    if (path / SWAPPED).is_dir():
        source = out.with_name(f"{out.name}.input")
        unswap(path, source)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # our tags carry no `latest`/iteration files
    )
    chatter = io.StringIO()  # progress bars and prints: not for a training log
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    finally:
        if source != path:
            shutil.rmtree(source, ignore_errors=True)


def unswap(path: Path, staging: Path) -> None:
    """With the optimizer on NVMe, DeepSpeed saves each swapped sub-group as empty placeholders
    in the optim_states files and copies the swap files themselves to
    offloaded_tensors/rankNN/ (`<first>_<last>.tensor.swp` for the fp32 master, `exp_avg-...`
    and `exp_avg_sq-...` for the moments). `staging` gets optim_states files with those
    tensors put back (what ds_to_universal and zero_to_fp32 read) and links to the model
    states."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    states = _model_states(path)
    world = int(states["dp_world_size"])
    numels = [  # each sub-group's partition on one rank: ceil(numel / world) per parameter
        sum(math.ceil(shape.numel() / world) for shape in group.values())
        for group in states["param_shapes"]
    ]
    for file in path.glob("*model_states.pt"):
        (staging / file.name).symlink_to(file.resolve())
    for file in sorted(path.glob("*optim_states.pt")):
        named_rank = re.search(r"zero_pp_rank_(\d+)_", file.name)
        assert named_rank is not None  # DeepSpeed names each rank's optimizer states so
        rank = int(named_rank.group(1))
        folder = path / SWAPPED / f"rank{rank:02d}"
        masters = sorted(  # sub-groups in order (moments: "<key>-<first>_<last>")
            (p.name.removesuffix(".tensor.swp") for p in folder.glob("[0-9]*_*.tensor.swp")),
            key=lambda stem: int(stem.split("_")[0]),
        )
        state = torch.load(file, map_location="cpu", weights_only=False)
        optimizer = state["optimizer_state_dict"]
        flats = optimizer["fp32_flat_groups"]
        empty = [i for i, flat in enumerate(flats) if flat.numel() == 0 and numels[i] > 0]
        if len(empty) != len(masters):
            raise ConfigError(
                f"ZT_RESUME: {path}: rank {rank}'s NVMe swap files ({len(masters)}) do not match "
                f"its offloaded optimizer groups ({len(empty)}); resume it on the topology that "
                "saved it, or set ZT_RESUME=never"
            )
        for group, stem in zip(empty, masters, strict=True):
            flats[group] = _raw(folder / f"{stem}.tensor.swp", numels[group])
            moments = optimizer["optimizer_state_dict"]["state"][group]
            for key in MOMENTS:
                moments[key] = _raw(folder / f"{key}-{stem}.tensor.swp", numels[group])
        torch.save(state, staging / file.name)


def _raw(path: Path, numel: int) -> torch.Tensor:
    """The first `numel` fp32 values of a swap file (the rest is I/O alignment padding)."""
    return torch.from_file(str(path), size=numel, dtype=torch.float32).clone()


def _from_torch_optimizer(states: dict[str, Any], names: list[str], out: Path) -> None:
    """ZeRO-0: the module holds the (fp32) weights, the optimizer a torch state dict."""
    optimizer = states.get("optimizer") or {}
    if "state" not in optimizer:
        raise ConfigError(
            "ZT_RESUME: this ZeRO-0 checkpoint keeps its optimizer in a layout zerotuner "
            "cannot move to another topology (fp16 without ZeRO); resume it with "
            "ZT_ZERO_STAGE=0 on the same number of ranks, or ZT_RESUME=never"
        )
    module = states["module"]
    for index, name in enumerate(names):
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        torch.save({"param": module[name].float()}, folder / "fp32.pt")
        state = optimizer["state"].get(index, {})
        for key in MOMENTS:
            if key in state:
                torch.save({"param": state[key].float()}, folder / f"{key}.pt")


def _base_optimizer(engine: Any) -> Any:
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer


def load_into(engine: Any, folder: Path, *, rank: int) -> int:
    """Set weights, masters, moments, step count and LR schedule (every rank; a collective at
    ZeRO-3). Returns the optimizer step count."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from zerotuner.weights.ema import full_parameters

    common = torch.load(folder / COMMON, map_location="cpu", weights_only=False)
    step = common["global_steps"] - common["skipped_steps"]
    module = engine.module
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    missing = [n for n, _ in named if not (folder / "zero" / n / "fp32.pt").is_file()]
    if missing:
        raise ConfigError(
            f"ZT_RESUME: the checkpoint does not match this model ({len(missing)} parameter(s) "
            f"missing, e.g. {missing[0]}); set ZT_MODEL to the model it was trained from"
        )
    base = _base_optimizer(engine)
    swapped = bool(getattr(engine.optimizer, "swap_optimizer", False))
    if not swapped:
        _ensure_state(engine, base, step)
    for start in range(0, len(named), GROUP):
        group = named[start : start + GROUP]
        values = {n: _read(folder, n, "fp32") for n, _ in group}
        with full_parameters(module, [p for _, p in group], modifier_rank=0):
            for name, param in group:
                if rank == 0 or not hasattr(param, "ds_id"):
                    param.data.copy_(values[name].view_as(param.data))
        if swapped:
            continue  # masters and moments below, one swap per sub-group
        for name, param in group:
            zero = hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")
            if zero:
                safe_set_full_fp32_param(param, values[name].flatten())
            for key in MOMENTS:
                moment = _read(folder, name, key, missing_ok=True)
                if moment is None:
                    continue
                if zero:
                    safe_set_full_optimizer_state(param, moment.flatten(), key)
                else:  # ZeRO-0, a plain torch/DeepSpeed Adam keyed by the parameter
                    state = base.state[param]
                    state[key] = moment.view_as(param.data).to(param.dtype).clone()
                    state["step"] = step
    if swapped:
        _set_swapped(engine.optimizer, named, folder, step)
    _set_step(base, step)
    scheduler = engine.lr_scheduler
    if scheduler is not None and common["lr_scheduler"] is not None:
        scheduler.load_state_dict(common["lr_scheduler"])
        if hasattr(scheduler, "last_batch_iteration"):  # DeepSpeed's schedulers
            # the optimizer's lr follows only on a scheduler step: re-apply the current one
            scheduler.step(scheduler.last_batch_iteration)
    engine.global_steps = common["global_steps"]
    engine.global_samples = common["global_samples"]
    engine.skipped_steps = common["skipped_steps"]
    return step


def _ensure_state(engine: Any, base: Any, step: int) -> None:
    """DeepSpeed's Adam creates its moments lazily at the first step (and ZeRO 1/2 link them
    to the parameters only then); before it there is nothing for safe_set_full_optimizer_state
    to write into, so create the (zero) moments and the links now."""
    wrapper = engine.optimizer
    flat = None
    for attribute in (
        "fp32_partitioned_groups_flat",  # ZeRO-3
        "single_partition_of_fp32_groups",  # ZeRO 1/2
        "fp32_groups_flat_partition",  # bf16 without ZeRO
    ):
        flat = flat or getattr(wrapper, attribute, None)
    if flat is None:
        return  # ZeRO-0 fp32: a plain optimizer, its state is set per parameter
    for tensor in flat:
        state = base.state[tensor]
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(tensor))
        state.setdefault("step", step)
    link = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _set_swapped(wrapper: Any, named: list[tuple[str, Any]], folder: Path, step: int) -> None:
    """ZeRO-3 with the optimizer on NVMe: each sub-group's fp32 master and moments live in swap
    files. Swap a sub-group in once, write every parameter's slice, swap it out (DeepSpeed's
    safe_set_full_* would swap the whole sub-group per parameter and per moment)."""
    members: dict[int, list[tuple[str, Any, int, int]]] = {}
    for name, param in named:
        group, offset, count = wrapper.grad_position[wrapper.get_param_id(param)]
        members.setdefault(group, []).append((name, param, offset, count))
    base = wrapper.optimizer
    for group, params in sorted(members.items()):
        flat = wrapper.fp32_partitioned_groups_flat[group]
        swapped = wrapper._swappable_optimizer_subgroup(group)  # small ones stay in memory
        if swapped:
            wrapper._optimizer_states_and_gradient_swap_in(group)
        state = base.state[flat]  # empty before the first step: Adam creates it lazily
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(flat))  # swapped out with the rest
        state.setdefault("step", step)
        for name, param, offset, count in params:
            first = count * wrapper._get_param_partition_rank(param)  # this rank's slice
            for key, target in (("fp32", flat), *((k, state[k]) for k in MOMENTS)):
                value = _read(folder, name, key, missing_ok=key != "fp32")
                if value is None:
                    continue
                piece = value.flatten()[first : first + count]  # the last slice is padded
                target.data.narrow(0, offset, piece.numel()).copy_(piece)
        if swapped:
            wrapper._optimizer_states_and_gradient_swap_out(group)


@overload
def _read(
    folder: Path, name: str, key: str, *, missing_ok: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def _read(folder: Path, name: str, key: str, *, missing_ok: bool) -> torch.Tensor | None: ...
def _read(folder: Path, name: str, key: str, *, missing_ok: bool = False) -> torch.Tensor | None:
    path = folder / "zero" / name / f"{key}.pt"
    if missing_ok and not path.is_file():
        return None
    value = torch.load(path, map_location="cpu", weights_only=False)
    return (value["param"] if isinstance(value, dict) else value).float()


def _set_step(base: Any, step: int) -> None:
    """Adam's bias correction needs the step count, kept per group or per state entry."""
    for group in base.param_groups:
        if "step" in group:
            group["step"] = step
    for state in base.state.values():
        if isinstance(state, dict) and "step" in state:
            old = state["step"]
            state["step"] = torch.tensor(step, dtype=old.dtype) if torch.is_tensor(old) else step
