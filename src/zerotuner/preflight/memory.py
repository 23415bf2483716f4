"""The memory of one plan row: device, host and disk bytes of a ZeRO stage x offload option.

Every number is a formula over the model's shape and what trains (`trainable.Training`):
the ZeRO paper's model states, the DeepSpeed buffers the in-step peak holds (bench/peak.py
measured them), activations scaled from a measured SDXL figure (ACT_BYTES_PER_IMAGE), and
fixed per-process host overheads. `plan.make_plan` adds the margins and chooses among the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zerotuner.families import REGISTRY, ModelShape
from zerotuner.machine.hardware import GiB
from zerotuner.preflight.optimizers import state_bytes
from zerotuner.preflight.trainable import Training, full_unet

if TYPE_CHECKING:
    from zerotuner.weights.base_precision import BaseBytes

# SDXL U-Net activations at 1024^2, bf16, per image (a measured figure, 6.4 GiB;
# 0.55 with gradient checkpointing). They scale with pixels and
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
VAE_CHUNK_FRAMES = 4 + 2  # a video VAE's chunk and its causal cache (AutoencoderKLWan)

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

MAX_BUCKET = 500_000_000  # DeepSpeed's default bucket (elements), capped like normalize does
STAGE3_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters default (elements)
PARAM_BUFFERS = 5  # offload_param.buffer_count default
PARAM_BUFFER_MAX = 100_000_000  # offload_param.buffer_size cap (elements), >= largest param
OPTIMIZER_NVME_BUFFERS = 4
SUB_GROUP_NVME = 100_000_000  # sub_group_size assumed with NVMe optimizer offload


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
    training: Training | None = None,
    frames: int = 1,
    base: BaseBytes | None = None,
    optimizer: str = "AdamW",
    offload_activations: str = "none",
    text_saved: int = 0,
) -> tuple[int, int, int, dict[str, int]]:
    """(device bytes per rank, host bytes per node, disk bytes per node, named parts).

    Model states with mixed-precision Adam (ZeRO paper): 16-bit params 2Psi, 16-bit grads
    2Psi, fp32 master + two moments 12Psi; without mixed precision fp32 params 4Psi, grads
    4Psi, moments 8Psi (also 16Psi). Stage 1 partitions the optimizer part over N ranks,
    stage 2 also the grads, stage 3 also the params. Offloading the optimizer moves its part
    and the fp32 grads it steps with to the host (or disk); with it, stage 2 streams reduced
    grads to the host during backward so the device keeps no gradient partition, while
    stage 1 keeps the full 16-bit grads until the step.

    `training` (default: the whole UNet) says which parameters train: gradients, optimizer
    states and the buffers they pass through count those only; a frozen base (LoRA) counts
    its weights, in the same dtype, replicated below ZeRO-3 and partitioned at ZeRO-3 (moved
    to the host or disk with parameter offload).

    `frames`: a video family's clip length (ZT_VIDEO_FRAMES): its activations count the
    clip's tokens (`families.VideoShape`), its VAE encodes the clip while caching.

    `base`: a LoRA's frozen denoiser stored in 8 bits (ZT_BASE_PRECISION; below ZeRO-3 only),
    as `base_precision.StoredLayers.at` plans it at this run's bytes per parameter.

    `optimizer`: ZT_OPTIMIZER's canonical name; its state bytes per trained parameter come
    from `optimizers.state_bytes` (AdamW's two moments: 8).

    `offload_activations` `cpu` (ZT_OFFLOAD_ACTIVATIONS, a video family with checkpointing):
    the blocks' saved inputs are in host memory (`activation_checkpoints`), not on the device.

    `text_saved`: the bytes the text encoders' 8-bit storage saves while caching
    (ZT_TEXT_ENCODER_PRECISION; the plan's `_Sizing.text_saved`).
    """
    training = training or full_unet(shape)
    p_bytes = 4 if precision == "no" else 2
    parts = _Parts()
    _weights(parts, shape, training, stage=stage, offload_param=offload_param,
             world_size=world_size, p_bytes=p_bytes)  # fmt: skip
    if base is not None and base.layers:
        _stored_base(parts, base, stage=stage)
    _optimizer_states(parts, training, stage=stage, offload_optimizer=offload_optimizer,
                      world_size=world_size, p_bytes=p_bytes, optimizer=optimizer)  # fmt: skip
    if offload_param == "nvme":  # buffer_size as normalize sets it (holds the largest tensor)
        size = max(shape.largest_param, min(PARAM_BUFFER_MAX, shape.denoiser_params // 8))
        parts.host["param_swap_buffers"] = PARAM_BUFFERS * size * p_bytes
    parts.device["buckets"] = _buckets(shape, training, stage=stage, p_bytes=p_bytes)
    offloaded = offload_activations == "cpu"
    parts.device["activations"] = _activations(
        shape, gradient_checkpointing, resolution=resolution, micro_batch=micro_batch,
        frames=frames, p_bytes=p_bytes, offloaded=offloaded,
    )  # fmt: skip
    if offloaded and shape.video is not None:
        inputs = shape.video.saved_inputs(shape.video.tokens(frames, resolution))
        parts.host["activation_checkpoints"] = int(inputs * (p_bytes / 2) * micro_batch)
    if not on_cpu:
        parts.device["framework"] = CUDA_CONTEXT
    caching = _caching(shape, resolution=resolution, frames=frames, p_bytes=p_bytes,
                       text_saved=text_saved)  # fmt: skip
    training_bytes = sum(parts.device.values())
    device = max(training_bytes, caching + (0 if on_cpu else CUDA_CONTEXT))
    if caching > training_bytes:
        parts.device["caching_peak"] = caching - training_bytes

    parts.host["process"] = RANK_PROCESS
    if not on_cpu:
        parts.host["cuda_host_context"] = CUDA_HOST_CONTEXT
    # The full fp32 copy every rank loads is gone (moved to the device, or cast and
    # partitioned by DeepSpeed) before offloaded states fill the host: `load_peak` counts it.
    host = ranks_per_node * sum(parts.host.values()) + ENTRYPOINT_PROCESS + TORCHRUN_AGENT
    if ema:  # one fp32 shadow per node (rank 0 keeps it), on the CPU, not sharded by DeepSpeed
        shadow = 4 * training.trainable_params
        host += shadow
        parts.host["ema_once_per_node"] = shadow
    if on_cpu:
        host += ranks_per_node * device  # the CPU accelerator's "device" memory is host memory
    disk = ranks_per_node * sum(parts.disk.values())
    return device, host, disk, parts.named()


@dataclass
class _Parts:
    """One option's bytes by part: per device, and per rank on the host and the offload disk."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)

    def on(self, offload: str) -> dict[str, int]:
        """Where an `offload_*` value ("none", "cpu" or "nvme") puts a part."""
        return {"none": self.device, "cpu": self.host, "nvme": self.disk}[offload]

    def named(self) -> dict[str, int]:
        """`estimate`'s parts: each part's bytes under "device.", "host_per_rank." or
        "disk_per_rank."."""
        named = {f"device.{k}": v for k, v in self.device.items()}
        named |= {f"host_per_rank.{k}": v for k, v in self.host.items()}
        return named | {f"disk_per_rank.{k}": v for k, v in self.disk.items()}


def _weights(
    parts: _Parts,
    shape: ModelShape,
    training: Training,
    *,
    stage: int,
    offload_param: str,
    world_size: int,
    p_bytes: int,
) -> None:
    """The trained and the frozen weights: whole on the device below ZeRO-3; at ZeRO-3 a
    partition where `offload_param` puts it, and every parameter gathered in forward and
    backward."""
    weights = {"params": training.trainable_params, "frozen_params": training.frozen_params}
    for name, count in weights.items():
        if not count:
            continue
        if stage < 3:
            parts.device[name] = p_bytes * count
        else:
            parts.on(offload_param)[name] = p_bytes * count // world_size
    if stage == 3:  # forward and backward gather every parameter, frozen ones included
        live = min(training.total_params, STAGE3_MAX_LIVE + bucket(shape))
        parts.device["gathered_params"] = p_bytes * live


def _stored_base(parts: _Parts, base: BaseBytes, *, stage: int) -> None:
    """The frozen base's stored layers at their stored bytes (8-bit values and a scale per
    row), and the upcast copy of one layer's weight that each matmul makes, forward and
    backward (base_precision.StoredLinear): the largest layer's, one at a time."""
    if stage == 3:  # refused before a plan is made (base_precision.stage_problem)
        raise ValueError("a base stored in 8 bits is never partitioned (ZeRO-3)")
    parts.device["frozen_params"] -= base.saved
    parts.device["frozen_base_upcast"] = base.largest_upcast


def _optimizer_states(
    parts: _Parts,
    training: Training,
    *,
    stage: int,
    offload_optimizer: str,
    world_size: int,
    p_bytes: int,
    optimizer: str = "AdamW",
) -> None:
    """The gradients and the optimizer's states of what trains, and the buffers the step
    passes them through: on the device, or (offloaded) on the host or the disk."""
    t, t_largest, n = training.trainable_params, training.largest_trainable, world_size
    # DeepSpeed keeps an fp32 master partition at stage >= 1 even without mixed precision.
    master = 0 if p_bytes == 4 and stage == 0 else 4
    o_bytes = master + state_bytes(optimizer, zero_stage=stage)
    dev, host = parts.device, parts.host
    if offload_optimizer == "none":
        dev["grads"] = p_bytes * t // (n if stage >= 2 else 1)
        dev["optimizer"] = int(o_bytes * t) // (n if stage >= 1 else 1)
        if stage in (1, 2):
            # The step flattens this rank's gradient partition into a new buffer (stage 1 at
            # its end-of-backward reduce) and casts it to the fp32 master's dtype: a 16-bit
            # flat copy plus its fp32 cast, or one fp32 copy (stage_1_and_2.py, step).
            dev["flat_grad_partition"] = (p_bytes + (0 if p_bytes == 4 else 4)) * t // n
        return
    if stage == 1:
        dev["grads"] = p_bytes * t  # reduced at the step, then copied to the host
    target = parts.on(offload_optimizer)
    target["optimizer"] = int(o_bytes * t) // n
    target["fp32_grads"] = 4 * t // n  # the fp32 grads the offloaded optimizer steps with
    if stage in (1, 2):
        # stage_1_and_2.py with cpu_offload: a 16-bit copy of the partition on the host
        # (param_buffer_of_bit16_for_cpu_offload_groups, the updated params go back to the
        # device through it) and one largest-parameter gradient staging buffer each side.
        host["param_partition_copy"] = p_bytes * t // n
        host["grad_staging"] = p_bytes * t_largest
        dev["grad_staging"] = p_bytes * t_largest
    if stage == 3:  # reduced 16-bit grad partitions wait on the host for the step
        host["grad_partitions"] = p_bytes * t // n
    if offload_optimizer == "nvme":  # pinned fp32 buffers of one sub-group each
        group = min(SUB_GROUP_NVME, max(t // n, t_largest))
        host["optimizer_swap_buffers"] = OPTIMIZER_NVME_BUFFERS * group * 4
        # stage3.py: swapped sub-groups step with their fp32 gradient in one host buffer
        # of the largest sub-group (gradient_buffer), kept for the whole run.
        host["subgroup_grad_buffer"] = group * 4


def _buckets(shape: ModelShape, training: Training, *, stage: int, p_bytes: int) -> int:
    """The flat buffers gradients are reduced through."""
    if stage == 0:
        # The engine's all-reduce flattens the gradients into buckets of 5e8 elements, at any
        # world size (engine.allreduce_no_retain; parameters without grad are skipped): the
        # whole gradient for models below that.
        return p_bytes * min(training.trainable_params, MAX_BUCKET)
    # One reduce_bucket_size buffer (sized by normalize from the whole UNet, whatever
    # trains): the all-gather after the step writes into the flat params in place, and
    # overlap_comm (the second, double buffer) is off below stage 3.
    return p_bytes * bucket(shape)


def _activations(
    shape: ModelShape,
    gradient_checkpointing: bool,
    *,
    resolution: int,
    micro_batch: int,
    frames: int,
    p_bytes: int,
    offloaded: bool = False,
) -> int:
    """The activations of a micro batch on the device (`offloaded`: a clip's checkpointed
    block inputs in host memory). The same for LoRA: every layer still passes gradients to its
    input, and the frozen layers' inputs a LoRA layer does not also read are the only tensors
    autograd skips (an upper bound, then)."""
    if shape.video is not None:  # a clip: frames x tokens (VideoShape), linear in tokens
        tokens = shape.video.tokens(frames, resolution)
        clip = shape.video.activations(tokens, gradient_checkpointing, offloaded=offloaded)
        return int(clip * (p_bytes / 2) * micro_batch)
    if shape.blocks is not None:  # measured per block: the image's tokens, the caption's fixed
        image = shape.blocks.at_resolution(resolution)[1 if gradient_checkpointing else 0]
        return int(image * (p_bytes / 2) * micro_batch)
    per_image = ACT_BYTES_PER_IMAGE_CHECKPOINTED if gradient_checkpointing else ACT_BYTES_PER_IMAGE
    width = shape.base_channels / REFERENCE_CHANNELS
    if shape.activations_1024 is not None:  # a transformer's, from its layers and width
        per_image, width = shape.activations_1024[1 if gradient_checkpointing else 0], 1.0
    scale = (resolution * resolution / REFERENCE_PIXELS) * width * (p_bytes / 2)
    return int(per_image * scale * micro_batch)


def _caching(
    shape: ModelShape, *, resolution: int, frames: int, p_bytes: int, text_saved: int = 0
) -> int:
    """The device bytes of caching latents and embeddings, before training: the frozen
    encoders (less `text_saved`, text encoders stored in 8 bits) and one VAE encode (an
    encoder that streams from host memory: its largest layer, `caching_params`, which an
    8-bit storage keeps: an embedding)."""
    vae_width = shape.vae_channels / REFERENCE_VAE_CHANNELS
    if shape.caching_params is None:
        on_device = shape.frozen_params * p_bytes - text_saved
    else:
        on_device = shape.caching_params * p_bytes
    encode = VAE_ENCODE_BYTES * resolution * resolution / REFERENCE_PIXELS * vae_width
    if shape.video is not None and frames > 1:
        # AutoencoderKLWan encodes a clip causally, its first frame then chunks of 4
        # (`_encode`), each causal convolution keeping its input's last 2 frames
        # (CACHE_T) for the next chunk: about 6 frames' encoding at once, plus the clip's
        # pixels (3 channels) and latents on the device.
        latent = shape.video.latent_frames(frames) * resolution * resolution
        latent = latent * shape.video.latent_channels // shape.video.spatial**2
        encode = encode * min(frames, VAE_CHUNK_FRAMES) + 2 * (3 * frames * resolution**2 + latent)
    return on_device + int(encode * (p_bytes / 2))


def bucket(shape: ModelShape) -> int:
    """ZeRO bucket size in elements: a tenth of the model, at least its largest tensor, at most
    DeepSpeed's default 5e8; a multiple of 8, as DeepSpeed asserts alignment on it."""
    size = int(min(MAX_BUCKET, max(shape.largest_param, shape.denoiser_params // 10)))
    return -(-size // 8) * 8


@dataclass(frozen=True)
class LoadPeak:
    """Host bytes per node before the DeepSpeed engine is ready, phase by phase.

    "full_copy" (stages 0-2): every local rank builds the whole trained UNet in fp32
    (`model.load_denoiser`) and keeps it while the dataset is encoded for the feature cache;
    `deepspeed.initialize` then moves or partitions it. "zero_init" (ZeRO-3, zero_init.py): each
    rank builds only its partition, in the training dtype, and holds one largest tensor more
    while the weights stream in. The VAE and text encoders load once per node, on its first
    rank, while caching (caching.py): the peak is the caching phase.
    """

    ranks_per_node: int
    per_rank: dict[str, int]  # process, cuda_host_context, the trained model's parts
    per_node: dict[str, int]  # entrypoint, torchrun_agent, frozen_parts (caching only)
    path: str = "full_copy"
    denoiser: str = "UNet"  # what trains, as the part names say it (a flow family: transformer)

    def part_names(self) -> dict[str, str]:
        """LOAD_PART_NAMES, naming the trained model as this family has it."""
        return {k: v.replace("UNet", self.denoiser) for k, v in LOAD_PART_NAMES.items()}

    def node_parts(self, phase: str) -> tuple[str, ...]:
        """The per-node parts live in `phase` ("load" or "caching")."""
        return tuple(k for k in self.per_node if phase == "caching" or k != "frozen_parts")

    def per_rank_bytes(self) -> int:
        return sum(self.per_rank.values())

    def phase_bytes(self, phase: str) -> int:
        node = sum(self.per_node[k] for k in self.node_parts(phase))
        return self.ranks_per_node * self.per_rank_bytes() + node

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_bytes("load"), self.phase_bytes("caching"))

    @property
    def trained_bytes(self) -> int:
        """Per rank: the trained model's host bytes while it loads (the full fp32 copy, or the
        partition, its swap buffers and the staging of one tensor)."""
        return sum(v for k, v in self.per_rank.items() if k in TRAINED_PARTS)

    def ranks_that_fit(self, usable: int) -> int:
        """How many ranks per node the usable host bytes hold through the load peak."""
        return max(0, (usable - sum(self.per_node.values())) // self.per_rank_bytes())


# What each load-time part is, for the plan's phase rows.
LOAD_PART_NAMES = {
    "process": "rank runtime",
    "cuda_host_context": "CUDA host context",
    "trained_model_fp32": "full fp32 UNet on every rank",
    "base_model_16bit": "full 16-bit LoRA base UNet on every rank",
    "trained_partition": "this rank's ZeRO-3 partition of the UNet (zero.Init)",
    "param_swap_buffers": "NVMe parameter swap buffers (zero.Init)",
    "load_staging": "one largest tensor read and gathered (zero.Init)",
    "frozen_parts": "VAE and text encoders, once per node (caching)",
}
TRAINED_PARTS = (
    "trained_model_fp32", "base_model_16bit", "trained_partition", "param_swap_buffers",
    "load_staging",
)  # fmt: skip


def load_peak(
    shape: ModelShape,
    *,
    ranks_per_node: int,
    precision: str,
    on_cpu: bool,
    zero_stage: int | None = None,
    offload_param: str = "none",
    world_size: int = 1,
    lora: bool = False,
    text_saved: int = 0,
) -> LoadPeak:
    """The load-time host peak per node. Below ZeRO-3 (or `zero_stage` None: the path before
    zero.Init) the UNet is read whole in fp32 (DeepSpeed makes its masters from it), a LoRA base
    (`lora`) in the run's 16-bit dtype (frozen: no masters; the adapter is added after). At
    ZeRO-3 (zero_init.py) a rank's host holds its partition in
    the training dtype (the CPU accelerator's "device" is host memory; on a GPU without
    parameter offload it is on the device), or with parameters on NVMe the swap buffers
    zero.Init allocates; and one largest tensor twice: read from the file (fp32 assumed) on rank
    0 and gathered in the training dtype on every rank. The frozen parts load once per node (its
    first rank encodes the node's share of the cache) and count at the training dtype, as the
    device's caching estimate does: the text encoders load in it (less `text_saved`, stored in
    8 bits), the fp32 VAE is the smallest part, and on a GPU each part leaves the host for the
    device once loaded."""
    p_bytes = 4 if precision == "no" else 2
    per_rank = {"process": RANK_PROCESS}
    if not on_cpu:
        per_rank["cuda_host_context"] = CUDA_HOST_CONTEXT
    path = "zero_init" if zero_stage == 3 else "full_copy"
    if path == "full_copy" and lora and p_bytes == 2:  # a frozen base loads in 16-bit
        per_rank["base_model_16bit"] = 2 * shape.denoiser_params
    elif path == "full_copy":
        per_rank["trained_model_fp32"] = 4 * shape.denoiser_params
    else:
        if offload_param == "nvme":
            size = max(shape.largest_param, min(PARAM_BUFFER_MAX, shape.denoiser_params // 8))
            per_rank["param_swap_buffers"] = PARAM_BUFFERS * size * p_bytes
        elif offload_param == "cpu" or on_cpu:
            per_rank["trained_partition"] = p_bytes * shape.denoiser_params // world_size
        per_rank["load_staging"] = (4 + p_bytes) * shape.largest_param
    per_node = {
        "entrypoint": ENTRYPOINT_PROCESS,
        "torchrun_agent": TORCHRUN_AGENT,
        "frozen_parts": p_bytes * shape.frozen_params - text_saved,
    }
    denoiser = "transformer" if REGISTRY[shape.family].flow else "UNet"
    return LoadPeak(ranks_per_node, per_rank, per_node, path, denoiser)
