"""Memory planning: which ZeRO stage and offload fit this job on this hardware, and why.

Each option (stage x optimizer offload x parameter offload x gradient checkpointing) gets an
estimate per device, per host (node) and per offload disk (node). The choice is the fastest
option that fits with a margin: least offload first (CPU transfers are the slowest part),
then no recomputation (gradient checkpointing costs ~30% compute), then the lowest stage
(each stage adds communication). LoRA (a frozen base, a small adapter) goes to ZeRO-3 only
when no lower stage fits: stages 1-2 shard only the adapter's gradients and optimizer state,
so the base's weights decide, and ZeRO-3 gathers all of them twice a step. A LoRA base stored
in 8 bits (ZT_BASE_PRECISION=fp8|int8) counts at its stored bytes and is never offered ZeRO-3
(DeepSpeed cannot partition it); `auto` keeps the run's precision, and where the run needs
parameter offload or does not fit, the plan shows what a base in 8 bits would let fit
(`Plan.low_base`) without choosing it: that changes the numerics, which only the user asks for.
All numbers are estimates from formulas, not measurements: see `Estimate.parts` for the terms
and `memory.py` for their sources.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.families import ModelShape, caption_cache_bytes
from zerotuner.machine.hardware import GiB, Hardware, auto_precision
from zerotuner.preflight.memory import TRAINED_PARTS, LoadPeak, estimate, load_peak
from zerotuner.preflight.memory import bucket as bucket  # deepspeed_config sizes buckets with it
from zerotuner.preflight.optimizers import client_problem, client_refuses, state_bytes
from zerotuner.preflight.pins import check_pins, legal, pin_text
from zerotuner.preflight.trainable import Training, full_unet
from zerotuner.settings.notes import Notes
from zerotuner.settings.schema import env_name
from zerotuner.weights import base_precision
from zerotuner.weights.base_precision import BaseBytes, StoredLayers

DEVICE_MARGIN = HOST_MARGIN = DISK_MARGIN = 0.10  # allocator fragmentation, spikes

# (stage, offload_optimizer, offload_param), in order of offload cost.
OFFLOADS: tuple[tuple[str, str], ...] = (
    ("none", "none"),
    ("cpu", "none"),
    ("cpu", "cpu"),
    ("nvme", "none"),
    ("nvme", "cpu"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)


@dataclass(frozen=True)
class Estimate:
    """One row of the plan table. Bytes are per device, per node (host) and per node (disk)."""

    zero_stage: int
    offload_optimizer: str
    offload_param: str
    gradient_checkpointing: bool
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    fits: bool
    short: tuple[str, ...] = ()  # which resource is short, e.g. "device 31.2 > 21.6 GiB"
    parts: dict[str, int] = field(default_factory=dict, compare=False)
    # `cpu`: checkpointed block inputs kept in host memory (ZT_OFFLOAD_ACTIVATIONS)
    offload_activations: str = "none"

    @property
    def offload_rank(self) -> int:
        return OFFLOADS.index((self.offload_optimizer, self.offload_param))

    def label(self) -> str:
        offload = []
        if self.offload_optimizer != "none":
            offload.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            offload.append(f"params->{self.offload_param}")
        ckpt = "checkpointing" if self.gradient_checkpointing else "no checkpointing"
        if self.offload_activations != "none":
            ckpt += f", activations->{self.offload_activations}"
        return f"ZeRO-{self.zero_stage}, {', '.join(offload) or 'no offload'}, {ckpt}"

    def choice(self) -> dict[str, Any]:
        return {
            "zero_stage": self.zero_stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "gradient_checkpointing": self.gradient_checkpointing,
            "offload_activations": self.offload_activations,
        }


@dataclass(frozen=True)
class Capacity:
    """What one option may use: the usable bytes after margins."""

    device: int  # per device (on the CPU accelerator: 0, devices share host memory)
    host: int  # per node
    disk: int | None  # per node; None = no offload disk measured
    device_total: int
    host_total: int


@dataclass(frozen=True)
class PlanRequest:
    """What the planner is asked to size: the job (resolution, micro batch, ranks) and what
    the user pinned ("auto": the planner chooses). `preflight.plan_for` builds it from the
    settings and the pins of the raw DeepSpeed config."""

    resolution: int  # pixels per side
    micro_batch: int  # images per device per step
    world_size: int  # ranks in the job
    ranks_per_node: int | None = None  # None: every rank on one node
    gradient_checkpointing: str | bool = "auto"
    zero_stage: str | int = "auto"
    offload_optimizer: str = "auto"  # auto | none | cpu | nvme
    offload_param: str = "auto"  # auto | none | cpu | nvme
    offload_activations: str = "auto"  # auto | none | cpu (a video family's, checkpointed)
    mixed_precision: str = "auto"  # auto | no | fp16 | bf16, as asked (resolve_precision)
    ema: bool = False  # an fp32 EMA copy on the host
    max_sequence_length: int | None = None  # the T5 tokens a flow family's cached caption holds
    frames: int = 1  # a video family's clip length (ZT_VIDEO_FRAMES); 1 for the image families
    base_precision: str = "auto"  # how a LoRA's frozen base is stored (ZT_BASE_PRECISION)
    # how the text encoders are stored while caching (ZT_TEXT_ENCODER_PRECISION), and what of
    # them that storage takes (base_precision.stored_text; None: not known, counted whole)
    text_encoder_precision: str = "auto"
    text_encoders: StoredLayers | None = None
    optimizer: str = "AdamW"  # ZT_OPTIMIZER, canonical: its state bytes (optimizers.STATE_BYTES)
    # where the pins came from (a raw DeepSpeed key instead of the ZT_* name), for messages
    pin_names: dict[str, str] = field(default_factory=dict)
    resolution_name: str = "ZT_RESOLUTION"  # what sets `resolution`, for messages


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made for, resolved (`plan --json`'s "inputs", in this order)."""

    family: str
    denoiser_params: int  # the denoiser's (UNet or transformer) parameters
    training_type: str  # full | lora
    text_encoders_train: bool
    trainable_params: int
    frozen_params: int
    resolution: int
    micro_batch: int
    world_size: int
    ranks_per_node: int
    precision: str  # the one DeepSpeed runs: no | fp16 | bf16
    accelerator: str
    device_memory_bytes: int  # per device; 0 on the CPU accelerator
    device_usable_bytes: int  # after the margin
    host_memory_bytes: int  # per node
    host_usable_bytes: int  # after the margin
    offload_disk_free_bytes: int | None
    ema: bool
    caption_cache_bytes: int  # one caption's cached text states
    # a video family's clip as planned: frames (ZT_VIDEO_FRAMES), latent frames and the
    # transformer's tokens per clip; None for the image families
    frames: int | None = None
    latent_frames: int | None = None
    tokens: int | None = None
    base_precision: str = "auto"  # a LoRA's frozen base as planned: auto, fp8 or int8
    optimizer: str = "AdamW"  # ZT_OPTIMIZER, canonical
    optimizer_state_bytes: float = 8.0  # its state per trained parameter, sharded (ZeRO >= 1)


@dataclass(frozen=True)
class LowBase:
    """What a LoRA base stored at `precision` would let fit where the run's precision needs
    parameter offload or does not fit: its rows that fit (stages 0-2) and the one the planner
    would choose. Shown, never chosen: `auto` keeps the numerics the user asked for."""

    precision: str
    rows: tuple[Estimate, ...]  # in order of preference
    base: BaseBytes

    @property
    def choice(self) -> Estimate:
        return self.rows[0]

    @property
    def setting(self) -> str:
        return f"{env_name('base_precision')}={self.precision}"

    def text(self) -> str:
        c = self.choice
        return (
            f"{self.setting} ({c.label()}: device {gib(c.device_bytes)} GiB, host "
            f"{gib(c.host_bytes)} GiB)"
        )


@dataclass(frozen=True)
class Plan:
    rows: tuple[Estimate, ...]
    choice: Estimate
    reasons: tuple[str, ...]
    inputs: PlanInputs
    load: LoadPeak
    unfit: str | None = None  # why the hardware planned for cannot run it; None: it can
    low_base: tuple[LowBase, ...] = ()  # what a base in 8 bits would let fit (auto: shown only)

    @property
    def load_fits(self) -> bool:
        return self.load.peak_bytes <= self.inputs.host_usable_bytes

    def phases(self) -> dict[str, dict[str, Any]]:
        """Host bytes per node by phase, and what is live in each."""
        names = self.load.part_names()
        out = {
            phase: {
                "host_bytes": self.load.phase_bytes(phase),
                "live": [
                    names[k]
                    for k in (*self.load.per_rank, *self.load.node_parts(phase))
                    if k in names
                ],
            }
            for phase in ("load", "caching")
        }
        out["training"] = {"host_bytes": self.choice.host_bytes, "live": [TRAINING_LIVE]}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice.choice(),
            "reasons": list(self.reasons),
            "inputs": asdict(self.inputs),
            "rows": [
                {k: v for k, v in asdict(r).items() if k != "short"}
                | {"short": list(r.short), "label": r.label()}
                for r in self.rows
            ],
            "load_peak": {
                "path": self.load.path,  # full_copy below ZeRO-3, zero_init at ZeRO-3
                "host_bytes": self.load.peak_bytes,
                "host_usable_bytes": self.inputs.host_usable_bytes,
                "fits": self.load_fits,
                "ranks_per_node": self.load.ranks_per_node,
                "per_rank": dict(self.load.per_rank),
                "per_node": dict(self.load.per_node),
                "phases": self.phases(),
            },
            "low_precision_base": [
                {
                    "precision": low.precision,
                    "setting": low.setting,
                    "choice": low.choice.choice(),
                    "frozen_base_bytes": low.base.after,
                    "rows": [asdict(r) | {"short": [], "label": r.label()} for r in low.rows],
                }
                for low in self.low_base
            ],
        }


TRAINING_LIVE = (
    "the choice's host parts (table's host column): the full copy and the frozen parts are gone"
)


def resolve_precision(
    requested: str, hardware: Hardware, notes: Notes | None = None, *, where: str | None = None
) -> str:
    """The precision DeepSpeed runs for `requested` (no | fp16 | bf16 | auto) on this hardware:
    the one the planner sizes and the DeepSpeed config enables. auto: bf16 where every GPU has
    it, fp16 on older GPUs, fp32 on the CPU; bf16 on a GPU without it: fp16, warned; fp16 on
    the CPU: an error (DeepSpeed's CPU accelerator has none). `notes`: where the warning and
    the error go (the planner passes none: normalize reports them). `where`: what asked for
    it, when not ZT_MIXED_PRECISION (e.g. the DeepSpeed config's fp16 section)."""
    notes = Notes() if notes is None else notes
    on_cpu = hardware.accelerator == "cpu"
    if requested == "auto":
        return auto_precision(hardware)
    if requested == "fp16" and on_cpu:
        asked = where or f"{env_name('mixed_precision')}=fp16"
        notes.error(f"{asked}: DeepSpeed's CPU accelerator has no fp16; use bf16, or no (fp32)")
    if requested == "bf16" and not on_cpu and not hardware.bf16:
        names = ", ".join(sorted({g.name for g in hardware.gpus})) or "this GPU"
        notes.warn(f"bf16 needs compute capability 8.0+ ({names} has less): using fp16")
        return "fp16"
    return requested


def capacity(hardware: Hardware, offload_disk_free: int | None) -> Capacity:
    host_total = hardware.host_memory
    device_total = 0 if hardware.accelerator == "cpu" else hardware.min_device_memory
    disk = None if offload_disk_free is None else int(offload_disk_free / (1 + DISK_MARGIN))
    return Capacity(
        device=int(device_total * (1 - DEVICE_MARGIN)),
        host=int(host_total * (1 - HOST_MARGIN)),
        disk=disk,
        device_total=device_total,
        host_total=host_total,
    )


def _shortfalls(
    device: int, host: int, disk: int, cap: Capacity, on_cpu: bool, nvme_ok: bool | None
) -> tuple[str, ...]:
    short = []
    if not on_cpu and device > cap.device:
        short.append(f"device {gib(device)} > {gib(cap.device)} GiB usable")
    if host > cap.host:
        short.append(f"host {gib(host)} > {gib(cap.host)} GiB usable")
    if disk:
        if nvme_ok is False:
            short.append("NVMe offload unavailable (DeepSpeed async_io cannot load: libaio)")
        if cap.disk is None:
            short.append(f"disk {gib(disk)} GiB: no offload disk measured (ZT_OFFLOAD_DIR)")
        elif disk > cap.disk:
            short.append(f"disk {gib(disk)} > {gib(cap.disk)} GiB usable")
    return tuple(short)


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def make_plan(
    *,
    shape: ModelShape,
    hardware: Hardware,
    request: PlanRequest,
    training: Training | None = None,
    offload_disk_free: int | None = None,
    require_fit: bool = True,
) -> Plan:
    """Estimate every option for `request` on `hardware`; choose the fastest that fits. Pinned
    values are kept. `training`: what trains (default: the whole UNet;
    `trainable.lora_adapter` for LoRA). `offload_disk_free`: bytes free for NVMe offload
    (None: no offload disk measured). `require_fit=False`: when nothing fits, plan the closest
    option anyway and say why in the reasons (and `Plan.unfit`).

    Raises ConfigError for an illegal pinned combination and EnvironmentUnfit (exit 3) when
    nothing fits, naming the closest option and what it lacks (the pins by `request.pin_names`).
    """
    names = {
        key: f"ZT_{key.upper()}"
        for key in ("zero_stage", "offload_optimizer", "offload_param", "gradient_checkpointing")
    } | request.pin_names
    if request.world_size < 1 or request.micro_batch < 1:
        raise ConfigError(
            f"world size {request.world_size} and micro batch {request.micro_batch} must be >= 1"
        )
    training = training or full_unet(shape)
    sizing = _Sizing(
        shape=shape,
        request=request,
        training=training,
        precision=resolve_precision(request.mixed_precision, hardware),
        on_cpu=hardware.accelerator == "cpu",
        cap=capacity(hardware, offload_disk_free),
        nvme_ok=hardware.nvme_offload_possible,
        base_precision=request.base_precision if training.type == "lora" else "auto",
    )
    check_pins(request.zero_stage, request.offload_optimizer, request.offload_param, names)
    stage_pin = None if request.zero_stage == "auto" else int(request.zero_stage)
    names_opt = {**names, "optimizer": "ZT_OPTIMIZER"}
    if why := client_problem(
        request.optimizer, stage_pin, request.offload_optimizer, names=names_opt
    ):
        raise ConfigError(why)
    _check_low_base_pins(sizing, names)
    rows = sizing.rows()
    if not rows:
        raise ConfigError(
            f"{names['zero_stage']}={request.zero_stage}, "
            f"{names['offload_optimizer']}={request.offload_optimizer}, "
            f"{names['offload_param']}={request.offload_param}: no DeepSpeed option matches "
            "these pins"
        )
    inputs = sizing.inputs(hardware, offload_disk_free)
    fitting = sorted((r for r in rows if r.fits), key=sizing.preference)
    if fitting:
        plan = _choose(sizing, rows, fitting, inputs)
    else:
        closest, unfit = _nothing_fits(sizing, rows, names)
        # `zerotuner config` on a laptop: show the config for the closest option, and why.
        reasons = (f"the hardware planned for cannot run it: {unfit}",)
        plan = Plan(tuple(rows), closest, reasons, inputs, sizing.load_for(closest), unfit)
    plan = _with_low_base(sizing, plan)
    if require_fit and plan.unfit:  # at preflight: before a rank starts, so before a download
        raise EnvironmentUnfit(plan.unfit)
    return plan


@dataclass(frozen=True)
class _Sizing:
    """What every option of one plan is sized for: the job asked, what trains, the precision
    DeepSpeed runs, and the capacity of the hardware."""

    shape: ModelShape
    request: PlanRequest
    training: Training
    precision: str
    on_cpu: bool
    cap: Capacity
    nvme_ok: bool | None  # whether NVMe offload can run here (None: not known)
    base_precision: str = "auto"  # how a LoRA's frozen base is stored (ZT_BASE_PRECISION)

    @property
    def ranks_per_node(self) -> int:
        return self.request.ranks_per_node or self.request.world_size

    @property
    def low_base(self) -> bool:
        """A LoRA base stored in 8 bits: never partitioned, so no ZeRO-3."""
        return base_precision.is_low(self.base_precision)

    @property
    def base(self) -> BaseBytes | None:
        """The frozen denoiser's bytes as stored, where it is stored in 8 bits."""
        stored = self.training.stored_base
        if stored is None or not self.low_base:
            return None
        return stored.at(self.base_precision, 4 if self.precision == "no" else 2)

    @property
    def text_saved(self) -> int:
        """Bytes the text encoders' low storage saves while caching (ZT_TEXT_ENCODER_PRECISION)."""
        precision, stored = self.request.text_encoder_precision, self.request.text_encoders
        if stored is None or not base_precision.is_low(precision):
            return 0
        return stored.at(precision, 4 if self.precision == "no" else 2).saved

    def preference(self, row: Estimate) -> tuple[int, ...]:
        return _preference_for(self.training)(row)

    def rows(self) -> list[Estimate]:
        """Every option the pins leave, estimated, in the table's order."""
        request = self.request
        stages = [0, 1, 2, 3] if request.zero_stage == "auto" else [int(request.zero_stage)]
        stages = [s for s in stages if not (self.low_base and s == 3)]
        asked = request.gradient_checkpointing
        ckpts = [False, True] if asked == "auto" else [bool(asked)]
        # (checkpointing, activations) pairs: activations leave the device only checkpointed
        # (the saved block inputs), and only a video family's are counted per block
        acts = {"auto": ["none", "cpu"], "none": ["none"], "cpu": ["cpu"]}
        wanted = acts[request.offload_activations] if self.shape.video else ["none"]
        kinds = [(c, a) for c in ckpts for a in wanted if c or a == "none"]
        rows = []
        for opt, param in OFFLOADS:
            if request.offload_optimizer not in ("auto", opt):
                continue  # pinned to another device
            if request.offload_param not in ("auto", param):
                continue
            for stage in stages:
                if legal(stage, opt, param) or client_refuses(request.optimizer, stage, opt):
                    continue
                rows += [self.estimate(stage, opt, param, c, a) for c, a in kinds]
        return sorted(rows, key=_table_order)

    def estimate(
        self, stage: int, opt: str, param: str, ckpt: bool, acts: str = "none"
    ) -> Estimate:
        request = self.request
        device, host, disk, parts = estimate(
            self.shape, stage=stage, offload_optimizer=opt, offload_param=param,
            gradient_checkpointing=ckpt, resolution=request.resolution,
            micro_batch=request.micro_batch, world_size=request.world_size,
            ranks_per_node=self.ranks_per_node, precision=self.precision, on_cpu=self.on_cpu,
            ema=request.ema, training=self.training, frames=request.frames, base=self.base,
            optimizer=request.optimizer, offload_activations=acts, text_saved=self.text_saved,
        )  # fmt: skip
        short = _shortfalls(device, host, disk, self.cap, self.on_cpu, self.nvme_ok)
        return Estimate(stage, opt, param, ckpt, device, host, disk, not short, short, parts,
                        offload_activations=acts)  # fmt: skip

    def inputs(self, hardware: Hardware, offload_disk_free: int | None) -> PlanInputs:
        shape, request, training, cap = self.shape, self.request, self.training, self.cap
        return PlanInputs(
            family=shape.family,
            denoiser_params=shape.denoiser_params,
            training_type=training.type,
            text_encoders_train=training.text_encoders,
            trainable_params=training.trainable_params,
            frozen_params=training.frozen_params,
            resolution=request.resolution,
            micro_batch=request.micro_batch,
            world_size=request.world_size,
            ranks_per_node=self.ranks_per_node,
            precision=self.precision,
            accelerator=hardware.accelerator,
            device_memory_bytes=cap.device_total,
            device_usable_bytes=cap.device,
            host_memory_bytes=cap.host_total,
            host_usable_bytes=cap.host,
            offload_disk_free_bytes=offload_disk_free,
            ema=request.ema,
            caption_cache_bytes=caption_cache_bytes(shape, request.max_sequence_length),
            **_clip(shape, request),
            base_precision=self.base_precision,
            optimizer=request.optimizer,
            optimizer_state_bytes=state_bytes(request.optimizer, zero_stage=1),
        )

    def load_for(self, row: Estimate, stage: int | None = None) -> LoadPeak:
        """The load path `row` runs: zero.Init at ZeRO-3, every rank's full copy below."""
        return load_peak(
            self.shape, ranks_per_node=self.ranks_per_node, precision=self.precision,
            on_cpu=self.on_cpu, zero_stage=row.zero_stage if stage is None else stage,
            offload_param=row.offload_param, world_size=self.request.world_size,
            lora=self.training.type == "lora", text_saved=self.text_saved,
        )  # fmt: skip


def _choose(
    sizing: _Sizing, rows: list[Estimate], fitting: list[Estimate], inputs: PlanInputs
) -> Plan:
    """The fastest option that fits (`fitting`, in order of preference) whose load the host
    also holds: below ZeRO-3 every rank of a node builds the full fp32 model, so a node with
    little host memory per GPU needs zero.Init's partitions."""
    cap = sizing.cap
    loads = [sizing.load_for(r) for r in fitting]
    pick = next((i for i, load in enumerate(loads) if load.peak_bytes <= cap.host), 0)
    choice, load = fitting[pick], loads[pick]
    reasons = _reasons(choice, rows, cap, sizing.precision, sizing.preference)
    if pick:
        reasons.insert(1, _load_reason(fitting[0], loads[0], cap))
    if sizing.training.type == "lora":
        reasons.insert(1, _lora_reason(choice, rows, sizing))
    unfit = None
    if load.peak_bytes > cap.host:
        zero3 = choice.zero_stage != 3 and sizing.load_for(choice, 3).peak_bytes <= cap.host
        unfit = _load_unfit(load, cap, zero3=zero3)
        reasons.insert(0, f"the hardware planned for cannot run it: {unfit}")
    return Plan(tuple(rows), choice, tuple(reasons), inputs, load, unfit)


def _nothing_fits(
    sizing: _Sizing, rows: list[Estimate], names: dict[str, str]
) -> tuple[Estimate, str]:
    """The option closest to fitting, and why none fits: its shortfalls, an NVMe volume that
    would do, and what to change."""
    request, cap = sizing.request, sizing.cap
    closest = min(rows, key=lambda r: _overshoot(r, cap, sizing.on_cpu))
    pins = pin_text(
        names,
        request.zero_stage,
        request.offload_optimizer,
        request.offload_param,
        request.gradient_checkpointing,
    )
    hint = ""
    disk_only = [r for r in rows if r.short and all(s.startswith("disk") for s in r.short)]
    if disk_only:
        best = min(disk_only, key=lambda r: (r.disk_bytes, sizing.preference(r)))
        need = int(best.disk_bytes * (1 + DISK_MARGIN))
        hint = (
            f"; {best.label()} would fit with {gib(need)} GiB free on an NVMe volume at "
            "ZT_OFFLOAD_DIR"
        )
    return closest, (
        f"nothing fits{pins}: closest is {closest.label()}, which needs "
        f"{'; '.join(closest.short)}{hint}; use more or larger GPUs, more host memory, a "
        f"smaller ZT_TRAIN_BATCH_SIZE or {request.resolution_name}, or offload to NVMe"
    )


def _clip(shape: ModelShape, request: PlanRequest) -> dict[str, int]:
    """A video family's clip as planned (PlanInputs' frames, latent frames and tokens)."""
    if shape.video is None:
        return {}
    return {
        "frames": request.frames,
        "latent_frames": shape.video.latent_frames(request.frames),
        "tokens": shape.video.tokens(request.frames, request.resolution),
    }


def _load_unfit(load: LoadPeak, cap: Capacity, *, zero3: bool = False) -> str:
    """One line: the load peak, what makes it, and the settings that would help (`zero3`:
    ZeRO-3's zero.Init load would fit)."""
    n = load.ranks_per_node
    need = math.ceil(load.peak_bytes / (1 - HOST_MARGIN) / GiB * 10) / 10  # rounded up
    ways = []
    if zero3:
        ways.append("set ZT_ZERO_STAGE=3 (zero.Init: each rank loads only its partition)")
    fewer = load.ranks_that_fit(cap.host)
    if 1 <= fewer < n:
        ways.append(f"set ZT_NUM_PROCESSES={fewer} (ranks per node; more nodes keep the world)")
    ways.append(f"use a host with at least {need:.1f} GiB of memory")
    return (
        f"load peak {gib(load.peak_bytes)} > {gib(cap.host)} GiB usable host: {_load_what(load)}; "
        f"{' or '.join(ways)}"
    )


def _load_what(load: LoadPeak) -> str:
    """What each rank holds at the load peak, in words."""
    names = load.part_names()
    trained = ", ".join(
        f"{names[k]} ({gib(v)} GiB)" for k, v in load.per_rank.items() if k in TRAINED_PARTS
    )
    frozen = gib(load.per_node["frozen_parts"])
    before = ", before DeepSpeed partitions anything" if load.path == "full_copy" else ""
    return (
        f"each of the {load.ranks_per_node} rank(s) on a node holds the "
        f"{trained or 'no model weights'}, and one of them the VAE and text encoders "
        f"({frozen} GiB) while caching{before}"
    )


def _load_reason(preferred: Estimate, load: LoadPeak, cap: Capacity) -> str:
    return (
        f"{preferred.label()} fits the devices but not the load (peak {gib(load.peak_bytes)} > "
        f"{gib(cap.host)} GiB usable host: {_load_what(load)}); ZeRO-3 builds each rank's "
        "partition only (zero.Init)"
    )


def _stage_preference(row: Estimate) -> int:
    # With the optimizer offloaded, stage 2 beats stage 1: same communication volume, and the
    # device never holds the full 16-bit gradients (stage 1 keeps them until the step).
    if row.offload_optimizer != "none":
        return {2: 0, 1: 1, 3: 2}[row.zero_stage]
    return row.zero_stage


def _preference(row: Estimate) -> tuple[int, int, int, int]:
    # Activations to the host copy each block's input out and back once a step: less traffic
    # than any parameter offload (every weight, every step), more than checkpointing alone.
    acts = int(row.offload_activations != "none")
    return (row.offload_rank, int(row.gradient_checkpointing), acts, _stage_preference(row))


def _lora_preference(row: Estimate) -> tuple[int, int, int, int, int]:
    return (int(row.zero_stage == 3), *_preference(row))


def _preference_for(training: Training) -> Callable[[Estimate], tuple[int, ...]]:
    return _lora_preference if training.type == "lora" else _preference


def _table_order(row: Estimate) -> tuple[int, int, int, int]:
    acts = int(row.offload_activations != "none")
    return (row.offload_rank, row.zero_stage, int(row.gradient_checkpointing), acts)


def _overshoot(row: Estimate, cap: Capacity, on_cpu: bool) -> float:
    """How far over its worst resource an option is (1.0 = exactly at the limit)."""
    ratios = [row.host_bytes / max(cap.host, 1)]
    if not on_cpu:
        ratios.append(row.device_bytes / max(cap.device, 1))
    if row.disk_bytes:
        ratios.append(row.disk_bytes / cap.disk if cap.disk else 1e9)
    return max(ratios)


def _reasons(
    choice: Estimate,
    rows: list[Estimate],
    cap: Capacity,
    precision: str,
    preference: Callable[[Estimate], tuple[int, ...]],
) -> list[str]:
    on_cpu = cap.device_total == 0
    where = "host (CPU accelerator)" if on_cpu else "device"
    usable = cap.host if on_cpu else cap.device
    used = choice.host_bytes if on_cpu else choice.device_bytes
    out = [
        f"{choice.label()}: {gib(used)} of {gib(usable)} GiB usable {where} memory "
        f"({int(DEVICE_MARGIN * 100)}% kept as margin), host {gib(choice.host_bytes)} of "
        f"{gib(cap.host)} GiB"
        + (f", disk {gib(choice.disk_bytes)} GiB" if choice.disk_bytes else "")
    ]
    cheaper = [r for r in rows if preference(r) < preference(choice)]
    if choice.offload_rank > 0:
        blocked = [r for r in cheaper if r.offload_rank < choice.offload_rank and not r.fits]
        if blocked:
            best = min(blocked, key=lambda r: _overshoot(r, cap, on_cpu))
            out.append(f"less offload does not fit: best was {best.label()} ({best.short[0]})")
    if choice.gradient_checkpointing:
        same = [
            r
            for r in rows
            if not r.gradient_checkpointing
            and r.offload_rank == choice.offload_rank
            and r.zero_stage == choice.zero_stage
        ]
        if same and not same[0].fits:
            out.append(
                f"gradient checkpointing is what makes it fit: without it {same[0].short[0]}"
            )
    if choice.offload_activations != "none":
        kept = [
            r
            for r in rows
            if r.gradient_checkpointing and r.offload_activations == "none"
            and r.offload_rank == choice.offload_rank and r.zero_stage == choice.zero_stage
        ]  # fmt: skip
        if kept and not kept[0].fits:
            out.append(
                "the checkpointed activations in host memory are what makes it fit: on the "
                f"device {kept[0].short[0]}"
            )
    if choice.offload_optimizer != "none" and choice.zero_stage == 2:
        out.append(
            "ZeRO-2 rather than ZeRO-1 with optimizer offload: the same communication, and "
            "reduced gradients stream to the host during backward, so the device never holds "
            "a full 16-bit gradient copy (the seed measured this setup)"
        )
    if choice.zero_stage > 0 and choice.offload_rank == 0:
        # (a lower stage that fits was passed over for its load: _load_reason says so)
        lower = [r for r in cheaper if r.zero_stage < choice.zero_stage and not r.fits]
        if lower:
            out.append(f"lower stages do not fit: {lower[0].label()} needs {lower[0].short[0]}")
    if choice.zero_stage == 0:
        out.append("ZeRO-0 fits: no partitioning, no extra communication")
    out.append(
        "precision fp32 (no mixed precision)" if precision == "no" else f"precision {precision}"
    )
    return out


def _lora_reason(choice: Estimate, rows: list[Estimate], sizing: _Sizing) -> str:
    """Why this stage for LoRA: what the frozen base and the adapter cost."""
    training, base = sizing.training, sizing.base
    p_bytes = 4 if sizing.precision == "no" else 2
    kind = "fp32" if p_bytes == 4 else "16-bit"
    frozen = p_bytes * training.frozen_params - (base.saved if base else 0)
    weights = f"{kind} weights"
    if base is not None:
        weights = (
            f"weights as stored ({env_name('base_precision')}={base.precision}: {base.layers} "
            f"Linear layers in 8 bits, the rest {kind}) and a {gib(base.largest_upcast)} GiB "
            "upcast copy of its largest layer for each matmul"
        )
    text = (
        f"LoRA: {training.trainable_params / 1e6:.1f}M adapter parameters train (grads, fp32 "
        f"master and Adam moments); the {training.frozen_params / 1e9:.2f}B-parameter base is "
        f"frozen, {gib(frozen)} GiB of {weights} with no grads or optimizer state"
    )
    if sizing.low_base:
        return text + (
            ", whole on every rank (ZeRO-3 is not offered: DeepSpeed cannot partition a base "
            f"stored at {sizing.base_precision})"
        )
    if choice.zero_stage < 3:
        return text + ", whole on every rank below ZeRO-3"
    where = {"none": "", "cpu": " and keeps it on the host", "nvme": " and keeps it on NVMe"}
    text = f"{text}; ZeRO-3 partitions it over the ranks{where[choice.offload_param]}"
    lower = [r for r in rows if r.zero_stage < 3 and not r.fits]
    if lower:  # not pinned: nothing below ZeRO-3 fits
        best = min(lower, key=lambda r: r.device_bytes)
        text += f", as no lower stage fits (best: {best.label()}, {best.short[0]})"
    return text


def _check_low_base_pins(sizing: _Sizing, names: dict[str, str]) -> None:
    """A stage or a parameter offload pinned (a DeepSpeed config's; the ZT_* pins are refused
    with the settings) that a base stored in 8 bits cannot run: one line naming both."""
    if not sizing.low_base:
        return
    request, precision = sizing.request, sizing.base_precision
    if str(request.zero_stage) == "3":
        raise ConfigError(base_precision.stage_problem(precision, f"{names['zero_stage']}=3"))
    if request.offload_param in ("cpu", "nvme"):
        pin = f"{names['offload_param']}={request.offload_param}"
        raise ConfigError(base_precision.offload_problem(precision, pin))


def _with_low_base(sizing: _Sizing, plan: Plan) -> Plan:
    """`plan` and what a LoRA base stored in 8 bits would let fit where, at the run's
    precision (ZT_BASE_PRECISION=auto), it needs parameter offload or does not fit: each
    precision whose rows fit (stages 0-2, the same pins) and whose load the host holds, said
    in the reasons (and in why nothing fits) with the setting to set. Never chosen. With a base
    in 8 bits that fits nowhere, why nothing fits says whether `auto` would (ZeRO-3)."""
    if sizing.training.stored_base is None:
        return plan
    if sizing.low_base:
        return _unless_auto(sizing, plan) if plan.unfit else plan
    if not plan.unfit and plan.choice.offload_param == "none":
        return plan
    options = []
    for precision in base_precision.LOW_PRECISIONS:
        low = replace(sizing, base_precision=precision)
        if (chosen := _fitting(low)) and low.base:
            options.append(LowBase(precision, chosen, low.base))
    if not options:
        return plan
    said = " or ".join(o.text() for o in options)
    auto = f"{env_name('base_precision')}=auto keeps the base at the run's precision"
    if plan.unfit:
        unfit = f"{plan.unfit}; or store the LoRA base in 8 bits, which fits: {said} ({auto})"
        return _unfit_as(plan, unfit, low_base=tuple(options))
    reason = (
        f"a LoRA base stored in 8 bits would fit without parameter offload: {said}; {auto} "
        "(8-bit storage changes the numerics slightly: set it to use it)"
    )
    return replace(plan, reasons=(*plan.reasons, reason), low_base=tuple(options))


def _unless_auto(sizing: _Sizing, plan: Plan) -> Plan:
    """A base in 8 bits that fits nowhere: whether the run's precision would, at ZeRO-3."""
    chosen = _fitting(replace(sizing, base_precision="auto"))
    if not chosen:
        return plan
    c = chosen[0]
    return _unfit_as(plan, (
        f"{plan.unfit}; or {env_name('base_precision')}=auto, whose ZeRO-3 fits ({c.label()}: "
        f"device {gib(c.device_bytes)} GiB, host {gib(c.host_bytes)} GiB)"
    ))  # fmt: skip


def _fitting(sizing: _Sizing) -> tuple[Estimate, ...]:
    """`sizing`'s rows that fit, in order of preference, where the host holds the first's
    load; none otherwise."""
    fitting = sorted((r for r in sizing.rows() if r.fits), key=sizing.preference)
    if not fitting or sizing.load_for(fitting[0]).peak_bytes > sizing.cap.host:
        return ()
    return tuple(fitting)


def _unfit_as(plan: Plan, unfit: str, **changes: Any) -> Plan:
    reasons = (f"the hardware planned for cannot run it: {unfit}", *plan.reasons[1:])
    return replace(plan, unfit=unfit, reasons=reasons, **changes)
