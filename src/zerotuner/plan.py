"""Memory planning: which ZeRO stage and offload fit this job on this hardware, and why.

Each option (stage x optimizer offload x parameter offload x gradient checkpointing) gets an
estimate per device, per host (node) and per offload disk (node). The choice is the fastest
option that fits with a margin: least offload first (CPU transfers are the slowest part),
then no recomputation (gradient checkpointing costs ~30% compute), then the lowest stage
(each stage adds communication). All numbers are estimates from formulas, not measurements:
see `Estimate.parts` for the terms and the module constants for their sources.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.families import ModelShape
from zerotuner.hardware import GiB, Hardware, auto_precision
from zerotuner.pins import check_pins, legal, pin_text

# DESIGN.md: SDXL U-Net activations at 1024^2, bf16, per image. They scale with pixels and
# with the width of the first block (320 in SDXL, SD1 and SD2), not with the parameter count:
# counting saved tensors of a checkpointed forward on the meta device gave SD1/SD2/SDXL within
# 10% of each other at equal pixels (SDXL 0.62, SD1 0.58, SD2 0.63 GiB at 1024^2).
ACT_BYTES_PER_IMAGE = 6.4 * GiB
ACT_BYTES_PER_IMAGE_CHECKPOINTED = 0.55 * GiB
REFERENCE_PIXELS = 1024 * 1024
REFERENCE_CHANNELS = 320
# VAE encoding while latents are cached (batch 1, 16-bit): an estimate, scaled by pixels and
# the VAE's first-block width (128 in every published SD/SDXL VAE).
VAE_ENCODE_BYTES = 3 * GiB
REFERENCE_VAE_CHANNELS = 128

CUDA_CONTEXT = 1 * GiB  # device memory: CUDA context, cuBLAS/cuDNN workspaces
# Host memory a process costs besides its tensors. Measured on the CPU path (bench, tiny demo,
# 2 ranks, peak RSS): a rank (Python, torch, DeepSpeed, diffusers, gloo, the cpu_adam
# extension, the feature cache) 575 MiB; `zerotuner train` 404 MiB; torchrun's agent 223 MiB.
RANK_PROCESS = int(0.6 * GiB)
ENTRYPOINT_PROCESS = int(0.4 * GiB)  # `zerotuner train`, once per node
TORCHRUN_AGENT = int(0.25 * GiB)  # the elastic agent, once per node
# On a CUDA host each rank also holds the driver's and libraries' host-side state (CUDA
# runtime, cuBLAS/cuDNN/NCCL kernel images and host buffers): not measurable here; about
# 1.7 GB more peak RSS once a CUDA tensor exists (pytorch/pytorch#113326, lazy module
# loading on), so 1.5 GiB per rank, keeping a CUDA rank at ~2 GiB as before.
CUDA_HOST_CONTEXT = int(1.5 * GiB)
FIXED_HOST_PARTS = ("process", "cuda_host_context", "model_load")
DEVICE_MARGIN = HOST_MARGIN = DISK_MARGIN = 0.10  # allocator fragmentation, spikes

MAX_BUCKET = 500_000_000  # DeepSpeed's default bucket (elements), capped like normalize does
STAGE3_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters default (elements)
PARAM_BUFFERS = 5  # offload_param.buffer_count default
PARAM_BUFFER_MAX = 100_000_000  # offload_param.buffer_size cap (elements), >= largest param
OPTIMIZER_NVME_BUFFERS = 4
SUB_GROUP_NVME = 100_000_000  # sub_group_size assumed with NVMe optimizer offload

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
        return f"ZeRO-{self.zero_stage}, {', '.join(offload) or 'no offload'}, {ckpt}"

    def choice(self) -> dict[str, Any]:
        return {
            "zero_stage": self.zero_stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "gradient_checkpointing": self.gradient_checkpointing,
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
class Plan:
    rows: tuple[Estimate, ...]
    choice: Estimate
    reasons: tuple[str, ...]
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice.choice(),
            "reasons": list(self.reasons),
            "inputs": self.inputs,
            "rows": [
                {k: v for k, v in asdict(r).items() if k != "short"}
                | {"short": list(r.short), "label": r.label()}
                for r in self.rows
            ],
        }


def resolve_precision(mixed_precision: str, hardware: Hardware) -> str:
    return auto_precision(hardware) if mixed_precision == "auto" else mixed_precision


def estimate(
    shape: ModelShape,
    *,
    stage: int,
    offload_optimizer: str,
    offload_param: str,
    gradient_checkpointing: bool,
    resolution: int,
    micro_batch: int,
    world_size: int,
    ranks_per_node: int,
    precision: str,
    on_cpu: bool,
    ema: bool,
) -> tuple[int, int, int, dict[str, int]]:
    """(device bytes per rank, host bytes per node, disk bytes per node, named parts).

    Model states with mixed-precision Adam (ZeRO paper): 16-bit params 2Psi, 16-bit grads
    2Psi, fp32 master + two moments 12Psi; without mixed precision fp32 params 4Psi, grads
    4Psi, moments 8Psi (also 16Psi). Stage 1 partitions the optimizer part over N ranks,
    stage 2 also the grads, stage 3 also the params. Offloading the optimizer moves its part
    and the fp32 grads it steps with to the host (or disk); with it, stage 2 streams reduced
    grads to the host during backward so the device keeps no gradient partition, while
    stage 1 keeps the full 16-bit grads until the step.
    """
    psi = shape.unet_params
    n = world_size
    p_bytes = 4 if precision == "no" else 2
    # DeepSpeed keeps an fp32 master partition at stage >= 1 even without mixed precision.
    o_bytes = 8 if precision == "no" and stage == 0 else 12
    g32 = 4  # fp32 grads the offloaded optimizer steps with
    dev: dict[str, int] = {}
    host_rank: dict[str, int] = {}  # per rank on this node
    disk_rank: dict[str, int] = {}

    # --- model states -----------------------------------------------------------------------
    if stage == 3:
        if offload_param == "none":
            dev["params"] = p_bytes * psi // n
        elif offload_param == "cpu":
            host_rank["params"] = p_bytes * psi // n
        else:
            disk_rank["params"] = p_bytes * psi // n
        live = min(psi, STAGE3_MAX_LIVE + bucket(shape))
        dev["gathered_params"] = p_bytes * live
    else:
        dev["params"] = p_bytes * psi
    if offload_optimizer == "none":
        dev["grads"] = p_bytes * psi // (n if stage >= 2 else 1)
        dev["optimizer"] = o_bytes * psi // (n if stage >= 1 else 1)
        if stage in (1, 2):
            # The step flattens this rank's gradient partition into a new buffer (stage 1 at
            # its end-of-backward reduce) and casts it to the fp32 master's dtype: a 16-bit
            # flat copy plus its fp32 cast, or one fp32 copy (stage_1_and_2.py, step).
            dev["flat_grad_partition"] = (p_bytes + (0 if p_bytes == 4 else 4)) * psi // n
    else:
        if stage == 1:
            dev["grads"] = p_bytes * psi  # reduced at the step, then copied to the host
        target = host_rank if offload_optimizer == "cpu" else disk_rank
        target["optimizer"] = o_bytes * psi // n
        target["fp32_grads"] = g32 * psi // n
        if stage in (1, 2):
            # stage_1_and_2.py with cpu_offload: a 16-bit copy of the partition on the host
            # (param_buffer_of_bit16_for_cpu_offload_groups, the updated params go back to the
            # device through it) and one largest-parameter gradient staging buffer each side.
            host_rank["param_partition_copy"] = p_bytes * psi // n
            host_rank["grad_staging"] = p_bytes * shape.largest_param
            dev["grad_staging"] = p_bytes * shape.largest_param
        if stage == 3:  # reduced 16-bit grad partitions wait on the host for the step
            host_rank["grad_partitions"] = p_bytes * psi // n
        if offload_optimizer == "nvme":  # pinned fp32 buffers of one sub-group each
            group = min(SUB_GROUP_NVME, max(psi // n, shape.largest_param))
            host_rank["optimizer_swap_buffers"] = OPTIMIZER_NVME_BUFFERS * group * 4
            # stage3.py: swapped sub-groups step with their fp32 gradient in one host buffer
            # of the largest sub-group (gradient_buffer), kept for the whole run.
            host_rank["subgroup_grad_buffer"] = group * 4
    if offload_param == "nvme":  # buffer_size as normalize sets it (holds the largest tensor)
        size = max(shape.largest_param, min(PARAM_BUFFER_MAX, psi // 8))
        host_rank["param_swap_buffers"] = PARAM_BUFFERS * size * p_bytes

    # --- buckets: gradients are reduced through flat buffers -----------------------------------
    if stage == 0:
        # The engine's all-reduce flattens the gradients into buckets of 5e8 elements, at any
        # world size (engine.allreduce_no_retain): the whole gradient for models below that.
        dev["buckets"] = p_bytes * min(psi, MAX_BUCKET)
    else:
        # One reduce_bucket_size buffer: the all-gather after the step writes into the flat
        # params in place, and overlap_comm (the second, double buffer) is off below stage 3.
        dev["buckets"] = p_bytes * bucket(shape)

    # --- activations ------------------------------------------------------------------------
    per_image = ACT_BYTES_PER_IMAGE_CHECKPOINTED if gradient_checkpointing else ACT_BYTES_PER_IMAGE
    width = shape.base_channels / REFERENCE_CHANNELS
    scale = (resolution * resolution / REFERENCE_PIXELS) * width * (p_bytes / 2)
    dev["activations"] = int(per_image * scale * micro_batch)

    if not on_cpu:
        dev["framework"] = CUDA_CONTEXT
    # Caching latents and embeddings runs before training: frozen encoders + one VAE encode.
    vae_width = shape.vae_channels / REFERENCE_VAE_CHANNELS
    caching = shape.frozen_params * p_bytes + int(
        VAE_ENCODE_BYTES * resolution * resolution / REFERENCE_PIXELS * vae_width * (p_bytes / 2)
    )
    training = sum(dev.values())
    device = max(training, caching + (0 if on_cpu else CUDA_CONTEXT))
    if caching > training:
        dev["caching_peak"] = caching - training

    host_rank["process"] = RANK_PROCESS
    if not on_cpu:
        host_rank["cuda_host_context"] = CUDA_HOST_CONTEXT
    # Every rank loads the full fp32 UNet (no zero.Init) before DeepSpeed partitions it; on the
    # CPU accelerator that copy becomes the "device" params, already counted.
    if not on_cpu:
        host_rank["model_load"] = 4 * psi
    # The loaded copy is gone (moved to the device, or became DeepSpeed's fp32 master) before
    # offloaded states fill the host.
    fixed = host_rank["process"] + host_rank.get("cuda_host_context", 0)
    offloaded = sum(v for k, v in host_rank.items() if k not in FIXED_HOST_PARTS)
    per_rank_host = fixed + max(offloaded, host_rank.get("model_load", 0))
    host = ranks_per_node * per_rank_host + ENTRYPOINT_PROCESS + TORCHRUN_AGENT
    if ema:  # one fp32 shadow per node (rank 0 keeps it), on the CPU, not sharded by DeepSpeed
        host += 4 * psi
        host_rank["ema_once_per_node"] = 4 * psi
    if on_cpu:
        host += ranks_per_node * device  # the CPU accelerator's "device" memory is host memory
    disk = ranks_per_node * sum(disk_rank.values())

    parts = {f"device.{k}": v for k, v in dev.items()}
    parts |= {f"host_per_rank.{k}": v for k, v in host_rank.items()}
    parts |= {f"disk_per_rank.{k}": v for k, v in disk_rank.items()}
    return device, host, disk, parts


def bucket(shape: ModelShape) -> int:
    """ZeRO bucket size in elements: a tenth of the model, at least its largest tensor, at most
    DeepSpeed's default 5e8; a multiple of 8, as DeepSpeed asserts alignment on it."""
    size = int(min(MAX_BUCKET, max(shape.largest_param, shape.unet_params // 10)))
    return -(-size // 8) * 8


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
    shape: ModelShape,
    hardware: Hardware,
    *,
    resolution: int,
    micro_batch: int,
    world_size: int,
    gradient_checkpointing: str | bool = "auto",
    zero_stage: str | int = "auto",
    offload_optimizer: str = "auto",
    offload_param: str = "auto",
    ema: bool = False,
    offload_disk_free: int | None = None,
    mixed_precision: str = "auto",
    ranks_per_node: int | None = None,
    require_fit: bool = True,
    pin_names: dict[str, str] | None = None,
) -> Plan:
    """Estimate every option; choose the fastest that fits. Pinned values are kept.

    Raises ConfigError for an illegal pinned combination and EnvironmentUnfit (exit 3) when
    nothing fits, naming the closest option and what it lacks. `pin_names`: where the pins came
    from (a raw DeepSpeed key instead of the ZT_* name), for those messages.
    """
    names = {
        key: f"ZT_{key.upper()}"
        for key in ("zero_stage", "offload_optimizer", "offload_param", "gradient_checkpointing")
    } | (pin_names or {})
    if world_size < 1 or micro_batch < 1:
        raise ConfigError(f"world size {world_size} and micro batch {micro_batch} must be >= 1")
    ranks_per_node = ranks_per_node or world_size
    precision = resolve_precision(mixed_precision, hardware)
    on_cpu = hardware.accelerator == "cpu"
    cap = capacity(hardware, offload_disk_free)
    check_pins(zero_stage, offload_optimizer, offload_param, names)
    stages = [0, 1, 2, 3] if zero_stage == "auto" else [int(zero_stage)]
    ckpts = [False, True] if gradient_checkpointing == "auto" else [bool(gradient_checkpointing)]

    rows = []
    for opt, param in OFFLOADS:
        if offload_optimizer not in ("auto", opt) or offload_param not in ("auto", param):
            continue
        for stage in stages:
            if legal(stage, opt, param):
                continue
            for ckpt in ckpts:
                device, host, disk, parts = estimate(
                    shape,
                    stage=stage,
                    offload_optimizer=opt,
                    offload_param=param,
                    gradient_checkpointing=ckpt,
                    resolution=resolution,
                    micro_batch=micro_batch,
                    world_size=world_size,
                    ranks_per_node=ranks_per_node,
                    precision=precision,
                    on_cpu=on_cpu,
                    ema=ema,
                )
                short = _shortfalls(device, host, disk, cap, on_cpu, hardware.nvme_offload_possible)
                rows.append(
                    Estimate(stage, opt, param, ckpt, device, host, disk, not short, short, parts)
                )
    if not rows:
        raise ConfigError(
            f"{names['zero_stage']}={zero_stage}, {names['offload_optimizer']}="
            f"{offload_optimizer}, {names['offload_param']}={offload_param}: no DeepSpeed option "
            "matches these pins"
        )
    rows.sort(key=_table_order)
    inputs = {
        "family": shape.family,
        "unet_params": shape.unet_params,
        "resolution": resolution,
        "micro_batch": micro_batch,
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        "precision": precision,
        "accelerator": hardware.accelerator,
        "device_memory_bytes": cap.device_total,
        "device_usable_bytes": cap.device,
        "host_memory_bytes": cap.host_total,
        "host_usable_bytes": cap.host,
        "offload_disk_free_bytes": offload_disk_free,
        "ema": ema,
    }
    fitting = sorted((r for r in rows if r.fits), key=_preference)
    if not fitting:
        closest = min(rows, key=lambda r: _overshoot(r, cap, on_cpu))
        pins = pin_text(names, zero_stage, offload_optimizer, offload_param, gradient_checkpointing)
        hint = ""
        disk_only = [r for r in rows if r.short and all(s.startswith("disk") for s in r.short)]
        if disk_only:
            best = min(disk_only, key=lambda r: (r.disk_bytes, _preference(r)))
            need = int(best.disk_bytes * (1 + DISK_MARGIN))
            hint = (
                f"; {best.label()} would fit with {gib(need)} GiB free on an NVMe volume at "
                "ZT_OFFLOAD_DIR"
            )
        message = (
            f"nothing fits{pins}: closest is {closest.label()}, which needs "
            f"{'; '.join(closest.short)}{hint}; use more or larger GPUs, more host memory, a "
            "smaller ZT_TRAIN_BATCH_SIZE or ZT_RESOLUTION, or offload to NVMe"
        )
        if require_fit:
            raise EnvironmentUnfit(message)
        # `zerotuner config` on a laptop: show the config for the closest option, and why.
        unfit = f"the hardware planned for cannot run it: {message}"
        return Plan(tuple(rows), closest, (unfit,), inputs)
    choice = fitting[0]
    return Plan(tuple(rows), choice, tuple(_reasons(choice, rows, cap, precision)), inputs)


def _stage_preference(row: Estimate) -> int:
    # With the optimizer offloaded, stage 2 beats stage 1: same communication volume, and the
    # device never holds the full 16-bit gradients (stage 1 keeps them until the step).
    if row.offload_optimizer != "none":
        return {2: 0, 1: 1, 3: 2}[row.zero_stage]
    return row.zero_stage


def _preference(row: Estimate) -> tuple[int, int, int]:
    return (row.offload_rank, int(row.gradient_checkpointing), _stage_preference(row))


def _table_order(row: Estimate) -> tuple[int, int, int]:
    return (row.offload_rank, row.zero_stage, int(row.gradient_checkpointing))


def _overshoot(row: Estimate, cap: Capacity, on_cpu: bool) -> float:
    """How far over its worst resource an option is (1.0 = exactly at the limit)."""
    ratios = [row.host_bytes / max(cap.host, 1)]
    if not on_cpu:
        ratios.append(row.device_bytes / max(cap.device, 1))
    if row.disk_bytes:
        ratios.append(row.disk_bytes / cap.disk if cap.disk else 1e9)
    return max(ratios)


def _reasons(choice: Estimate, rows: list[Estimate], cap: Capacity, precision: str) -> list[str]:
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
    cheaper = [r for r in rows if _preference(r) < _preference(choice)]
    if choice.offload_rank > 0:
        blocked = [r for r in cheaper if r.offload_rank < choice.offload_rank]
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
    if choice.offload_optimizer != "none" and choice.zero_stage == 2:
        out.append(
            "ZeRO-2 rather than ZeRO-1 with optimizer offload: the same communication, and "
            "reduced gradients stream to the host during backward, so the device never holds "
            "a full 16-bit gradient copy (the seed measured this setup)"
        )
    if choice.zero_stage > 0 and choice.offload_rank == 0:
        lower = [r for r in cheaper if r.zero_stage < choice.zero_stage]
        if lower:
            out.append(f"lower stages do not fit: {lower[0].label()} needs {lower[0].short[0]}")
    if choice.zero_stage == 0:
        out.append("ZeRO-0 fits: no partitioning, no extra communication")
    out.append(
        "precision fp32 (no mixed precision)" if precision == "no" else f"precision {precision}"
    )
    return out
