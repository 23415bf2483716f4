"""Settings + hardware + model shape + plan decisions -> one DeepSpeed config, explained.

`normalize` is pure: it deep-copies the user's DeepSpeed dict, resolves every "auto", applies
the high-level settings the user set explicitly (reporting each override), enforces what
DeepSpeed silently gets wrong (offload legality, batch arithmetic, old key names), and returns
the config with the list of everything it changed and why. All problems are raised at once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotuner.families import ModelShape
from zerotuner.machine.hardware import Hardware
from zerotuner.preflight.memory import SUB_GROUP_NVME
from zerotuner.preflight.optimizers import (
    KNOBS,
    ONE_BIT,
    REFUSED,
    canonical_optimizer,
    canonical_scheduler,
    client_problem,
    is_client,
    valid_optimizer_names,
)
from zerotuner.preflight.pins import config_precision, illegal_at
from zerotuner.preflight.plan import bucket as plan_bucket
from zerotuner.preflight.plan import resolve_precision
from zerotuner.settings.config_values import (
    coerce_numbers,
    config_section,
    deepspeed_accepts,
    is_number,
    no_auto_left,
    no_non_finite,
)
from zerotuner.settings.notes import Note, Notes
from zerotuner.settings.offload_path import NvmePath, conflict, is_placeholder, same_folder
from zerotuner.settings.schema import Settings, env_name, precision_name

AIO_DEFAULTS = {
    "block_size": 1 << 20,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}
MIN_NVME_OPTIMIZER_BUFFERS = 4  # DeepSpeed's pipelined optimizer swapper needs four
DEFAULT_PARAM_BUFFERS = 5


@dataclass(frozen=True)
class Decisions:
    """What the planner (or the user) fixed; normalize applies it and checks it."""

    zero_stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    gradient_checkpointing: bool = False
    offload_activations: str = "none"  # none | cpu: checkpointed block inputs in host memory


@dataclass(frozen=True)
class Normalized:
    config: dict[str, Any]
    notes: tuple[Note, ...]
    mixed_precision: str  # bf16 | fp16 | no, as written into the config


def normalize(
    base: dict[str, Any],
    *,
    settings: Settings,
    hardware: Hardware,
    shape: ModelShape,
    world_size: int,
    decisions: Decisions,
    source: str | None = None,
) -> Normalized:
    """The DeepSpeed config DeepSpeed will run, and every change made to get there."""
    cfg = copy.deepcopy(base) if isinstance(base, dict) else {}
    n = Notes()
    ctx = _Context(cfg, settings, n, source or "the DeepSpeed config")
    no_non_finite(cfg, "", n)
    coerce_numbers(cfg, "", n)
    _batch(ctx, world_size)
    _optimizer(ctx)
    _scheduler(ctx)
    precision = _precision(ctx, hardware)
    _zero(ctx, decisions, hardware, shape)
    _optimizer_runs_here(ctx, hardware)
    _client_optimizer_fits(ctx)
    ctx.take(("gradient_clipping",), "gradient_clipping")
    # zerotuner's own progress log replaces DeepSpeed's periodic step print.
    cfg.setdefault("steps_per_print", settings.max_steps + 1)
    cfg.setdefault("wall_clock_breakdown", False)
    no_auto_left(cfg, "", n)
    n.raise_problems()
    deepspeed_accepts(cfg, n)
    n.raise_problems()
    return Normalized(cfg, tuple(n.notes), precision)


class _Context:
    """The config being built, the settings, and where overrides are reported."""

    def __init__(self, cfg: dict[str, Any], settings: Settings, notes: Notes, source: str):
        self.cfg, self.settings, self.n, self.source = cfg, settings, notes, source
        self.explicit = settings.model_fields_set

    def take(self, path: tuple[str, ...], field: str, value: Any = None) -> Any:
        """An explicit setting wins; a value in the user's config wins over a default."""
        value = getattr(self.settings, field) if value is None else value
        tree = self.cfg
        for key in path[:-1]:
            tree = tree.setdefault(key, {})
        current = tree.get(path[-1])
        dotted = ".".join(path)
        if field in self.explicit:
            if current not in (None, "auto") and current != value:
                self.n.change(
                    f"{env_name(field)}={value!r} overrides {dotted}={current!r} from {self.source}"
                )
            tree[path[-1]] = value
        elif current in (None, "auto"):
            tree[path[-1]] = value
            self.n.info(f"{dotted}={value!r} from {env_name(field)}")
        return tree[path[-1]]


def _known(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _batch(ctx: _Context, world_size: int) -> None:
    """train_batch_size = micro * accumulation * world size, checked rather than inferred."""
    cfg, s, n = ctx.cfg, ctx.settings, ctx.n
    explicit_micro = "train_batch_size" in ctx.explicit
    explicit_accum = "gradient_accumulation_steps" in ctx.explicit
    micro = _known(cfg.get("train_micro_batch_size_per_gpu"))
    accum = _known(cfg.get("gradient_accumulation_steps"))
    for key, field, given, is_explicit in (
        ("train_micro_batch_size_per_gpu", "train_batch_size", micro, explicit_micro),
        ("gradient_accumulation_steps", "gradient_accumulation_steps", accum, explicit_accum),
    ):
        value = getattr(s, field)
        if is_explicit and given is not None and given != value:
            n.change(f"{env_name(field)}={value} overrides {key}={given} from {ctx.source}")
    micro = s.train_batch_size if explicit_micro else micro
    accum = s.gradient_accumulation_steps if explicit_accum else accum
    total = _known(cfg.get("train_batch_size"))
    if micro is None and accum is None:
        accum = s.gradient_accumulation_steps
    if total is not None and (micro is None or accum is None):
        known = micro if micro is not None else accum
        assert known is not None  # with both unset, accumulation took its setting above
        if total % (known * world_size):
            n.error(
                f"train_batch_size={total} is not divisible by "
                f"{'train_micro_batch_size_per_gpu' if micro else 'gradient_accumulation_steps'}"
                f"={known} x world size {world_size}"
            )
            return
        derived = total // (known * world_size)
        micro, accum = (micro, derived) if micro is not None else (derived, accum)
        n.info(f"derived micro batch {micro} x accumulation {accum} from train_batch_size={total}")
    micro = s.train_batch_size if micro is None else micro
    accum = s.gradient_accumulation_steps if accum is None else accum
    expected = micro * accum * world_size
    if total is not None and total != expected:
        if explicit_micro or explicit_accum:
            n.change(
                f"train_batch_size={total} from {ctx.source} recomputed as {expected} "
                f"(micro {micro} x accumulation {accum} x world size {world_size})"
            )
        else:
            n.error(
                f"train_batch_size={total} contradicts train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accum} x world size {world_size} = {expected}; "
                f"fix one of them or set {env_name('train_batch_size')} (per device)"
            )
            return
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = accum
    cfg["train_batch_size"] = expected


OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "AdamW": {"betas": [0.9, 0.999], "eps": 1e-8},
    "Adam": {"betas": [0.9, 0.999], "eps": 1e-8},
    "Lamb": {"betas": [0.9, 0.999], "eps": 1e-8},
    "Lion": {"betas": [0.9, 0.99]},
    "Adagrad": {"eps": 1e-8},
    "Muon": {},
    # client optimizers (train/optimizer.py builds them): their published defaults
    "prodigy": {"betas": [0.9, 0.999], "eps": 1e-8},
    "adamw_schedulefree": {"betas": [0.9, 0.999], "eps": 1e-8},
    "adamw8bit": {"betas": [0.9, 0.999], "eps": 1e-8},
    "adafactor": {"clip_threshold": 1.0, "decay_rate": -0.8},
}
PRODIGY_LR = 1.0  # Prodigy's lr multiplies the step size it estimates: 1.0 is its default


def _optimizer(ctx: _Context) -> None:
    cfg, s, n = ctx.cfg, ctx.settings, ctx.n
    section = config_section(cfg, "optimizer")
    given = section.get("type")
    if given in (None, "auto") or "optimizer" in ctx.explicit:
        if given not in (None, "auto") and given != s.optimizer:
            n.change(f"{env_name('optimizer')}={s.optimizer!r} overrides optimizer.type={given!r}")
        given = s.optimizer
    name, warning = canonical_optimizer(str(given))
    if name is None:
        n.error(f"optimizer {given!r} is unknown; valid: {valid_optimizer_names()}")
        return
    if warning:
        n.warn(warning)
    if name in REFUSED:
        stage_note = " (1-bit optimizers refuse ZeRO stages >= 1)" if name in ONE_BIT else ""
        n.error(f"optimizer {name}: {REFUSED[name]}{stage_note}; valid: {valid_optimizer_names()}")
        return
    params = dict(config_section(section, "params"))
    if "max_grad_norm" in params:
        clip = params.pop("max_grad_norm")
        if cfg.get("gradient_clipping") in (None, "auto") and is_number(clip):
            cfg["gradient_clipping"] = float(clip)
        n.warn(
            f"optimizer.params.max_grad_norm={clip!r} is not a DeepSpeed optimizer parameter: "
            "moved to gradient_clipping"
        )
    cfg["optimizer"] = {"type": name, "params": params}
    prodigy_lr = name == "prodigy" and "learning_rate" not in ctx.explicit
    if prodigy_lr and params.get("lr") in (None, "auto"):
        params["lr"] = PRODIGY_LR
        n.info(f"optimizer.params.lr={PRODIGY_LR} (Prodigy estimates its step size; "
               f"{env_name('learning_rate')} scales it)")  # fmt: skip
    ctx.take(("optimizer", "params", "lr"), "learning_rate")
    ctx.take(("optimizer", "params", "weight_decay"), "weight_decay")
    for key, value in OPTIMIZER_DEFAULTS[name].items():
        if params.get(key) in (None, "auto"):
            params[key] = value
    _client_params(ctx, name)


def _client_params(ctx: _Context, name: str) -> None:
    """A client optimizer's knobs from their settings; a knob set for another one refused."""
    n, s = ctx.n, ctx.settings
    for field, owner in KNOBS.items():
        if owner == name:
            ctx.take(("optimizer", "params", field.removeprefix(f"{owner}_")), field)
    for field in sorted((set(KNOBS) & ctx.explicit) - {f for f, o in KNOBS.items() if o == name}):
        n.error(
            f"{env_name(field)} is a {KNOBS[field]} setting, but {env_name('optimizer')}="
            f"{s.optimizer}: set {env_name('optimizer')}={KNOBS[field]} or unset {env_name(field)}"
        )
    if name == "adamw_schedulefree":
        ctx.take(("optimizer", "params", "warmup_steps"), "lr_warmup_steps")


def _optimizer_runs_here(ctx: _Context, hardware: Hardware) -> None:
    """DeepSpeed's CPU accelerator has no fused Lamb or Lion kernels (CPU Lion needs offload)."""
    if hardware.accelerator != "cpu":
        return
    name = ctx.cfg.get("optimizer", {}).get("type")
    offload = ctx.cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    if name == "Lamb":
        ctx.n.error(
            "optimizer Lamb has no CPU implementation in DeepSpeed; on the CPU use AdamW, Adam, "
            "Adagrad, or Lion with ZT_OFFLOAD_OPTIMIZER=cpu"
        )
    elif name == "Lion" and offload == "none":
        ctx.n.error(
            "optimizer Lion runs on the CPU only as DeepSpeed's CPU Lion: set "
            f"{env_name('offload_optimizer')}=cpu (ZeRO >= 1) or use AdamW"
        )


def _client_optimizer_fits(ctx: _Context) -> None:
    """What DeepSpeed 0.19 runs with an optimizer it did not build (engine._configure_optimizer,
    zero/stage3.py), decided before the ranks start."""
    cfg, n = ctx.cfg, ctx.n
    name = cfg.get("optimizer", {}).get("type")
    if not is_client(str(name)):
        return
    zero = cfg["zero_optimization"]
    stage = zero.get("stage", 0)
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    opt, off, stage_name = (env_name(k) for k in ("optimizer", "offload_optimizer", "zero_stage"))
    if stage >= 1:  # ZeRO asserts on an optimizer outside its own list without this
        cfg["zero_allow_untested_optimizer"] = True
    if name == "prodigy" and stage == 3:
        _one_sub_group(ctx, zero)
    names = {"optimizer": opt, "offload_optimizer": off, "zero_stage": stage_name}
    if why := client_problem(str(name), stage, offload, names=names):
        n.error(why)
    if offload == "cpu":
        if cfg.get("zero_force_ds_cpu_optimizer") is True:
            n.error(
                f"{opt}={name} with {off}=cpu needs zero_force_ds_cpu_optimizer: false, but "
                f"{ctx.source} sets it true: remove it, or use {opt}=AdamW (DeepSpeed's CPU Adam)"
            )
        else:
            cfg["zero_force_ds_cpu_optimizer"] = False
            n.info(
                f"{name} steps the offloaded state on the CPU in PyTorch "
                "(zero_force_ds_cpu_optimizer: false): slower than DeepSpeed's CPU Adam"
            )


ONE_SUB_GROUP = 10**12  # elements: every rank's ZeRO-3 partition in one optimizer step


def _one_sub_group(ctx: _Context, zero: dict[str, Any]) -> None:
    """ZeRO-3 steps the optimizer once per sub-group of a rank's partition (stage3.py
    _optimizer_step): Prodigy would estimate d from one sub-group at a time and count each call
    as a step. One sub-group per rank keeps it one step over the whole partition."""
    given = zero.get("sub_group_size", "auto")
    if given not in (None, "auto") and int(given) < ONE_SUB_GROUP:
        ctx.n.change(
            f"zero_optimization.sub_group_size {given} -> {ONE_SUB_GROUP}: Prodigy steps a "
            "rank's whole ZeRO-3 partition at once (its d sums over all of it)"
        )
    zero["sub_group_size"] = ONE_SUB_GROUP
    ctx.n.info(f"zero_optimization.sub_group_size={ONE_SUB_GROUP} (Prodigy: one sub-group)")


# ZT_LR_SCHEDULER -> the DeepSpeed scheduler that gives that shape after the warm-up.
SCHEDULER_TYPES = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}


def _scheduler(ctx: _Context) -> None:
    cfg, s, n = ctx.cfg, ctx.settings, ctx.n
    section = cfg.get("scheduler")
    lr = cfg.get("optimizer", {}).get("params", {}).get("lr", s.learning_rate)
    if cfg.get("optimizer", {}).get("type") == "adamw_schedulefree":
        _schedule_free_lr(ctx, lr)
        return
    if not isinstance(section, dict) or "lr_scheduler" in ctx.explicit:
        section = {"type": SCHEDULER_TYPES[s.lr_scheduler], "params": {}}
        n.info(f"scheduler {section['type']} from {env_name('lr_scheduler')}={s.lr_scheduler}")
    name = canonical_scheduler(str(section.get("type")))
    if name is None:
        n.error(
            f"scheduler {section.get('type')!r} is unknown; valid: WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle, LRRangeTest"
        )
        return
    params = dict(section.get("params") or {})
    cfg["scheduler"] = {"type": name, "params": params}
    if name in ("WarmupLR", "WarmupDecayLR"):
        params.setdefault("warmup_min_lr", 0)
        if params.get("warmup_min_lr") == "auto":
            params["warmup_min_lr"] = 0
        ctx.take(("scheduler", "params", "warmup_max_lr"), "learning_rate", lr)
        params.setdefault("warmup_type", "linear")
    if name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        warmup = ctx.take(("scheduler", "params", "warmup_num_steps"), "lr_warmup_steps")
        if warmup == 0:
            # DeepSpeed needs >= 1 warm-up step; starting that step at the peak means none.
            params["warmup_num_steps"] = 1
            if name == "WarmupCosineLR":
                params["warmup_min_ratio"] = 1.0
            else:
                params["warmup_min_lr"] = params.get("warmup_max_lr", lr)
            n.info("no warm-up: one DeepSpeed warm-up step that starts at the peak LR")
    if name in ("WarmupDecayLR", "WarmupCosineLR"):
        ctx.take(("scheduler", "params", "total_num_steps"), "max_steps")
    if name == "WarmupCosineLR":
        params.setdefault("warmup_min_ratio", 0.0)
        params.setdefault("cos_min_ratio", 0.01)


def _schedule_free_lr(ctx: _Context, lr: Any) -> None:
    """Schedule-free replaces the schedule (its warm-up is the optimizer's warmup_steps):
    DeepSpeed's LR stays at the peak from the first step."""
    s, n = ctx.settings, ctx.n
    if "lr_scheduler" in ctx.explicit and s.lr_scheduler != "constant":
        n.error(
            f"{env_name('lr_scheduler')}={s.lr_scheduler} with {env_name('optimizer')}="
            f"adamw_schedulefree: schedule-free needs no schedule; use "
            f"{env_name('lr_scheduler')}=constant (warm-up: {env_name('lr_warmup_steps')})"
        )
    if isinstance(ctx.cfg.get("scheduler"), dict):
        n.change("scheduler replaced: adamw_schedulefree keeps the learning rate flat")
    ctx.cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": lr, "warmup_max_lr": lr, "warmup_num_steps": 1,
                   "warmup_type": "linear"},
    }  # fmt: skip
    n.info(f"schedule-free: flat LR {lr}, warm-up of {s.lr_warmup_steps} step(s) in the optimizer")


def _precision(ctx: _Context, hardware: Hardware) -> str:
    cfg, s, n = ctx.cfg, ctx.settings, ctx.n
    bf16, fp16 = config_section(cfg, "bf16"), config_section(cfg, "fp16")
    if bf16.get("enabled") is True and fp16.get("enabled") is True:
        n.error(f"bf16 and fp16 are both enabled in {ctx.source}: enable at most one")
        return "no"
    from_config = config_precision(cfg)
    where = None
    if from_config is not None and "mixed_precision" not in ctx.explicit:
        requested, where = from_config, f"{from_config}.enabled in {ctx.source}"
    else:
        requested = s.mixed_precision
        if from_config is not None and requested != from_config:
            given = precision_name(from_config)
            n.change(f"{env_name('mixed_precision')}={requested} overrides {given} in config")
    precision = resolve_precision(requested, hardware, n, where=where)
    cfg["bf16"] = {**bf16, "enabled": precision == "bf16"}
    fp16_section = {**fp16, "enabled": precision == "fp16"}
    if precision == "fp16":
        fp16_section.setdefault("loss_scale", 0)  # dynamic loss scaling
        fp16_section.setdefault("initial_scale_power", 16)
    cfg["fp16"] = fp16_section
    n.info(f"precision: {precision_name(precision)}")
    return precision


def _bucket_sizes(shape: ModelShape) -> dict[str, int]:
    """accelerate's "auto" uses hidden_size**2; UNets have none, so use the real tensors."""
    bucket = plan_bucket(shape)
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(bucket * 0.9),
        "stage3_param_persistence_threshold": 10 * math.isqrt(shape.largest_param),
    }


def _zero(ctx: _Context, d: Decisions, hardware: Hardware, shape: ModelShape) -> None:
    cfg, n = ctx.cfg, ctx.n
    zero = cfg.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    cfg["zero_optimization"] = zero
    old = zero.get("stage")
    if old not in (None, "auto") and old != d.zero_stage:
        n.change(f"zero_optimization.stage {old} -> {d.zero_stage} ({_why_stage(ctx)})")
    zero["stage"] = d.zero_stage
    stage = d.zero_stage
    for key, value in _bucket_sizes(shape).items():
        if key.startswith("stage3_") and stage < 3:
            continue
        if zero.get(key) in (None, "auto") and stage >= 1:
            zero[key] = value
            n.info(f"zero_optimization.{key}={value} from the model's parameter shapes")
    if stage == 3:
        if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
            n.change("stage3_gather_16bit_weights_on_model_save -> true (needed to export)")
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    pin = hardware.accelerator == "cuda"
    optimizer = _offload_target(ctx, "offload_optimizer", d.offload_optimizer, stage)
    param = _offload_target(ctx, "offload_param", d.offload_param, stage)
    _offload_section(ctx, zero, "offload_optimizer", optimizer, stage, pin, shape)
    _offload_section(ctx, zero, "offload_param", param, stage, pin, shape)
    if optimizer == "nvme":
        _sub_group(ctx, zero)
    if "nvme" in (optimizer, param):
        _aio(ctx)
    elif "aio" in cfg:
        n.info("aio section kept but unused: nothing is offloaded to NVMe")
    if stage == 0:
        for key in list(zero):
            if key != "stage":
                zero.pop(key)


def _sub_group(ctx: _Context, zero: dict[str, Any]) -> None:
    """NVMe optimizer: one sub-group's fp32 state sits in host buffers (DeepSpeed's default,
    1e9 elements, is the whole of most models); the planner's host row counts SUB_GROUP_NVME."""
    size = zero.get("sub_group_size", "auto")
    if size in (None, "auto"):
        zero["sub_group_size"] = SUB_GROUP_NVME
        ctx.n.info(f"zero_optimization.sub_group_size={SUB_GROUP_NVME} (NVMe optimizer swap)")
    elif int(size) != SUB_GROUP_NVME:
        ctx.n.info(f"zero_optimization.sub_group_size={size} kept (planned: {SUB_GROUP_NVME})")


def _why_stage(ctx: _Context) -> str:
    if "zero_stage" in ctx.explicit:
        return f"{env_name('zero_stage')}={ctx.settings.zero_stage}"
    return "the planner's choice"


def _offload_target(ctx: _Context, key: str, target: str, stage: int) -> str:
    n = ctx.n
    if target == "none":
        return "none"
    if stage == 0:
        n.warn(f"{key}={target} needs ZeRO stage >= 1: not offloading at stage 0")
        return "none"
    if key == "offload_param" and stage < 3:
        n.warn(f"offload_param={target} only works at ZeRO stage 3: dropped at stage {stage}")
        return "none"
    if key == "offload_optimizer" and target == "nvme" and stage < 3:
        if {"zero_stage", "offload_optimizer"} <= ctx.explicit:
            n.error(
                f"{env_name('offload_optimizer')}=nvme needs {env_name('zero_stage')}=3 "
                f"(at stage {stage} DeepSpeed would silently use cpu); use cpu or stage 3"
            )
            return "none"
        n.warn(f"offload_optimizer=nvme only works at stage 3: using cpu at stage {stage}")
        return "cpu"
    return target


def _offload_section(
    ctx: _Context,
    zero: dict[str, Any],
    key: str,
    target: str,
    stage: int,
    pin: bool,
    shape: ModelShape,
) -> None:
    n, s = ctx.n, ctx.settings
    section = zero.get(key)
    section = dict(section) if isinstance(section, dict) else {}
    device = section.get("device")
    if device not in (None, "auto", target):
        why = illegal_at(stage, key, str(device).lower())
        if why:  # the raw config's own stage cannot run it (pins() left it to the planner)
            n.warn(f"zero_optimization.{key}.device {device} -> {target}: {why}")
        else:
            why = env_name(key) if key in ctx.explicit else "the planner's choice"
            n.change(f"zero_optimization.{key}.device {device} -> {target} ({why})")
    if target == "none":
        zero.pop(key, None)
        return
    section["device"] = target
    if section.get("pin_memory") in (None, "auto"):
        section["pin_memory"] = pin
    if target == "nvme":
        _nvme_path(ctx, key, section, str(s.offload_dir))
    else:
        section.pop("nvme_path", None)
    if key == "offload_param":
        size = section.get("buffer_size", "auto")
        largest = shape.largest_param
        if size in (None, "auto"):
            section["buffer_size"] = max(largest, min(100_000_000, shape.denoiser_params // 8))
            n.info(f"offload_param.buffer_size={section['buffer_size']} (largest tensor {largest})")
        elif int(size) < largest:
            n.change(
                f"offload_param.buffer_size {size} -> {largest}: it must hold the largest "
                f"parameter ({largest} elements)"
            )
            section["buffer_size"] = largest
        if section.get("buffer_count") in (None, "auto"):
            section["buffer_count"] = DEFAULT_PARAM_BUFFERS
    elif target == "nvme":
        count = section.get("buffer_count", "auto")
        if count in (None, "auto") or int(count) < MIN_NVME_OPTIMIZER_BUFFERS:
            if count not in (None, "auto"):
                n.change(f"offload_optimizer.buffer_count {count} -> 4 (DeepSpeed needs >= 4)")
            section["buffer_count"] = MIN_NVME_OPTIMIZER_BUFFERS
    zero[key] = section


def _nvme_path(ctx: _Context, key: str, section: dict[str, Any], offload_dir: str) -> None:
    """The swap goes to the job's one offload dir, which a real nvme_path already decided
    (offload_path); a real path that differs from it here was never resolved: refused."""
    current = section.get("nvme_path")
    if current is not None and is_placeholder(current):
        message = (
            f"zero_optimization.{key}.nvme_path placeholder {current!r} -> {offload_dir} "
            f"({env_name('offload_dir')})"
        )
        # An example path copied from the docs is a value the user may think is used: shown
        # by default (a change); "auto", "none" or an empty one asked to be filled (info).
        (ctx.n.change if str(current).strip().startswith("/") else ctx.n.info)(message)
    elif current is not None and not same_folder(str(current), offload_dir):
        where = f"zero_optimization.{key}.nvme_path in {ctx.source}"
        ctx.n.error(conflict(Path(offload_dir), NvmePath(Path(str(current)), where)))
    section["nvme_path"] = offload_dir


def _aio(ctx: _Context) -> None:
    aio = ctx.cfg.get("aio")
    aio = dict(aio) if isinstance(aio, dict) else {}
    if "thread_count" in aio:
        value = aio.pop("thread_count")
        aio.setdefault("intra_op_parallelism", value)
        ctx.n.change(
            f"aio.thread_count={value} renamed intra_op_parallelism (DeepSpeed ignores the old key)"
        )
    for key, value in AIO_DEFAULTS.items():
        if aio.get(key) in (None, "auto"):
            aio[key] = value
    ctx.cfg["aio"] = aio
