"""A model's shape before any weights exist: parameter counts (from safetensors headers, or
on the meta device), the VAE's scale and channels, a transformer's activations and a video
family's clip geometry: what memory planning and bucket sizing read (`ModelShape`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotuner.families.registry import REGISTRY, VAE_SCALE, Family, get
from zerotuner.families.stored import model_json, stored_config, stored_counts, unet_config_path
from zerotuner.families.wan_variants import has_experts

# Wan's transformer block (diffusers 0.42 WanTransformerBlock) in 16-bit: the bytes autograd
# saves for backward, counted on the meta device with torch.autograd.graph.saved_tensors_hooks
# (tests/test_plan_video.py recounts them at 1.3B's, 5B's and 14B's widths), SDPA saving what
# a fused kernel saves (query, key, value and output; flash and memory-efficient attention keep
# no tokens x tokens matrix, so memory is linear in tokens, plus each head's fp32 logsumexp,
# counted here for self- and cross-attention). Per video token and layer: 76 x width (the block
# normalises and modulates in fp32: each norm's fp32 input and modulated output; q and k
# before and after their RMS norms and RoPE; the self- and cross-attention projections' inputs
# and outputs) + 4 x ffn_dim (the GELU's input and output) + 36 (the norms' statistics). Per
# text token and layer: 16 x width + 4 (cross-attention's keys, before and after their norm,
# the norm's statistic, and values). Korthikanti et al.'s 34 x tokens x width
# (`transformer_activations`) counts a standard GPT block with no fp32 norms, no cross-attention
# and a 4x MLP: 2-3x less here.
WAN_TOKEN_WIDTH_BYTES, WAN_TOKEN_FFN_BYTES, WAN_TOKEN_BYTES = 76, 4, 36
WAN_TEXT_WIDTH_BYTES, WAN_TEXT_BYTES = 16, 4
LSE_BYTES = 2 * 4  # fp32 logsumexp per head per token: self- and cross-attention
# LTX-2's block (diffusers 0.42 LTX2VideoTransformerBlock, its video stream isolated from the
# audio one as families/ltx2.py trains it) in 16-bit, counted the same way on the CPU at two
# widths (64 and 128: 5672 and 11320 bytes per video token and layer, 776 and 1548 per text
# token): per video token and layer 88 x width (its 4x GELU feed-forward included: no ffn_dim
# in its config) + 8 + the logsumexp per head; per text token and layer 12 x width + 8.
LTX2_TOKEN_WIDTH_BYTES, LTX2_TOKEN_BYTES = 88, 8
LTX2_TEXT_WIDTH_BYTES, LTX2_TEXT_BYTES = 12, 8
# HunyuanVideo 1.5's block (diffusers 0.42 HunyuanVideo15TransformerBlock: one joint attention
# over the clip's tokens and the text's, both streams normalised, modulated and fed forward
# alike) in 16-bit, counted the same way on the meta device at widths 1024 and 2048 (SDPA
# saving query, key, value and output): per video token and layer 62 x width + 8 per head (q's
# and k's RMS statistics) + 1040, per text token 62 x width + 8 per head + 16, plus the
# logsumexp per head (4 bytes: one attention). The text in every block is Qwen's tokens (the
# caption length), ByT5's 256 and the 729 vision tokens, padding included. Its attention mask
# is a dense boolean tokens x tokens matrix (the processor builds it from the text mask), which
# no fused kernel takes as it is: SDPA turns it into a 16-bit bias the memory-efficient kernel
# saves for the backward, 2 bytes per token pair and layer, while the boolean matrix and its
# transpose's AND (1 byte each) live during the block's forward. That quadratic term is read
# from the code, not measured on a device: at 121 frames of 480p it is ~5 GB a layer.
HV15_TOKEN_WIDTH_BYTES, HV15_HEAD_BYTES, HV15_TOKEN_BYTES, HV15_TEXT_BYTES = 62, 8 + 4, 1040, 16
HV15_PAIR_BYTES, HV15_MASK_BYTES = 2, 2
HV15_JOINT_TEXT = 256 + 729  # ByT5's tokens and the vision tokens, beside Qwen's
HV15_VAE_SCALES = (4, 16)  # AutoencoderKLHunyuanVideo15's defaults, the published VAE's


@dataclass(frozen=True)
class VideoShape:
    """A video family's clip in the transformer: how frames and pixels become tokens (the
    VAE's compression, the transformer's patch) and what each token's activations cost.

    Latent frames: (frames - 1) / temporal + 1 (the causal VAE keeps the first frame alone);
    tokens: latent frames / patch_t x (pixels / spatial^2 / (patch_h x patch_w)), the pixels of
    ZT_RESOLUTION^2 (the area buckets are cut at: 832 x 480 fits in 632^2)."""

    temporal: int  # frames per latent frame (Wan's VAE: 4)
    spatial: int  # pixels per latent cell side (Wan 2.1's VAE 8, Wan 2.2 TI2V-5B's 16)
    patch: tuple[int, int, int]  # the transformer's (frames, height, width) patch
    layers: int
    token_bytes: int  # per video token and layer, 16-bit, without checkpointing
    input_bytes: int  # per video token and layer with checkpointing: the block's input
    text_bytes: int  # per layer: the text's keys and values (the cached caption's tokens)
    rope_bytes: int  # per video token, once: RoPE's fp32 cos and sin, shared by every layer
    latent_channels: int = 16
    # A joint attention with a dense mask (HunyuanVideo 1.5's): the text tokens beside the
    # clip's in it, the bytes per token pair each layer saves, and those the block's forward
    # holds for the mask meanwhile (once)
    joint_text: int = 0
    pair_bytes: int = 0
    mask_bytes: int = 0

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.temporal + 1

    def tokens(self, frames: int, resolution: int) -> int:
        cell = self.spatial * self.spatial * self.patch[1] * self.patch[2]
        return -(-self.latent_frames(frames) // self.patch[0]) * (resolution * resolution // cell)

    def activations(self, tokens: int, checkpointing: bool, *, offloaded: bool = False) -> int:
        """16-bit device bytes for `tokens`: every layer's saved tensors, or with checkpointing
        each block's input (its hidden states: 2 x width per token; in host memory when
        `offloaded`, `saved_inputs`) plus one block recomputed; a dense joint attention mask's
        `pair_bytes` per token pair in each layer, `mask_bytes` once."""
        pairs = (tokens + self.joint_text) ** 2 if self.pair_bytes else 0
        layer = self.token_bytes * tokens + self.text_bytes + self.pair_bytes * pairs
        once = self.rope_bytes * tokens + self.mask_bytes * pairs
        if not checkpointing:
            return self.layers * layer + once
        inputs = 0 if offloaded else self.saved_inputs(tokens)
        return inputs + layer + once

    def saved_inputs(self, tokens: int) -> int:
        """16-bit bytes of the blocks' inputs gradient checkpointing keeps for the backward."""
        return self.layers * self.input_bytes * tokens


@dataclass(frozen=True)
class ModelShape:
    """What memory planning and bucket sizing need to know about the trained model (a UNet,
    or a flow family's transformer: `denoiser_params` counts it all the same)."""

    family: Family
    denoiser_params: int
    largest_param: int  # elements of the biggest tensor (offload buffer_size must hold it)
    frozen_params: int
    native_resolution: int
    source: str  # "built-in sdxl config" or the config file it was counted from
    base_channels: int = 320  # block_out_channels[0]: activation memory scales with it
    vae_channels: int = 128  # the VAE's block_out_channels[0]: so does encoding's memory
    # A transformer's activations per image at 1024 px in 16-bit (without, with gradient
    # checkpointing); None: a UNet's, scaled from a measured SDXL figure by base_channels
    # (preflight/memory.ACT_BYTES_PER_IMAGE).
    activations_1024: tuple[int, int] | None = None
    text_width: int = 2048  # width of the text states it attends to (a cached caption's)
    # Frozen parameters on the device while caching: frozen_params, less what streams from host
    # memory (Spec.text_stream_params; None: none does)
    caching_params: int | None = None
    # A video family's clip geometry and activations per token (None: an image family)
    video: VideoShape | None = None
    # Wan 2.2 A14B: its two expert transformers' boundary_ratio (model_index.json; nan: the
    # index names a transformer_2 without one); None: a model with one denoiser
    boundary_ratio: float | None = None
    # An image transformer's activations measured per block (MEASURED_BLOCKS): the planner counts
    # its image tokens at the run's resolution and its text's as they are; None: activations_1024
    blocks: MeasuredBlocks | None = None


def caption_cache_bytes(shape: ModelShape, max_sequence_length: int | None = None) -> int:
    """Disk bytes of one caption's cached text states: CLIP's 77 tokens in fp32 for the UNet
    families; a flow family's CLIP and T5 tokens in bf16 (T5-XXL is 4096 wide)."""
    spec = REGISTRY[shape.family]
    if not spec.flow:
        return spec.clip_tokens * shape.text_width * 4
    text = max_sequence_length or spec.t5_tokens
    # Qwen-Image-Edit's: its controls' tokens (the Plus model's: its most, 3)
    vision = spec.controls * spec.control_text_tokens
    return ((spec.clip_tokens + text + vision) * shape.text_width + spec.other_text_values) * 2


# a pipeline's frozen parts: up to four text encoders (HiDream's: CLIP-L, CLIP-G, T5, Llama),
# the VAE, and LTX-2's connectors, audio VAE and vocoder
FROZEN_PARTS = (
    "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "vae", "connectors",
    "audio_vae", "vocoder", "image_encoder",  # an image-to-video family's (Wan 2.1 I2V's CLIP)
)  # fmt: skip


def frozen_params(
    model_dir: Path,
    parts: tuple[str, ...] = FROZEN_PARTS,
) -> int:
    """Parameters of the text encoders, VAE and image encoder (or `parts`) of a local pipeline,
    from their safetensors headers, else counted on the meta device (LTX-2's connectors, audio
    VAE and vocoder too: diffusers classes its model_index.json names)."""
    total = 0
    for sub in parts:
        folder = model_dir / sub
        if not (folder / "config.json").is_file():
            continue
        if stored := stored_counts(folder):
            total += stored[0]
            continue
        index = model_dir / "model_index.json"  # Qwen-Image's VAE is another class
        named = model_json(index).get(sub) if index.is_file() else None
        library, diffusers_class = named if named and named[0] != "transformers" else (None, None)
        if sub == "vae" and not diffusers_class:
            library, diffusers_class = "diffusers", "AutoencoderKL"
        config = (folder / "config.json").read_text()
        total += _counted_on_meta(str(folder), config, library, diffusers_class)
    return total


@functools.lru_cache(maxsize=16)  # per config: a plan counts the same encoders again (the
def _counted_on_meta(  # builder, bench's tables); building a 6B UMT5 on meta takes ~1 s
    folder: str, config: str, library: str | None, diffusers_class: str | None
) -> int:
    """Parameters of the part in `folder` (its `config` the key), built on the meta device: a
    diffusers class of `library` (a pipeline's own module: LTX-2's `ltx2`), else the
    transformers architecture its config names."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if diffusers_class:
            import importlib

            import diffusers

            module = diffusers if library == "diffusers" else (
                importlib.import_module(f"diffusers.pipelines.{library}"))  # fmt: skip
            cls = getattr(module, diffusers_class)
            model = cls.from_config(cls.load_config(folder))
        else:
            import transformers

            loaded = transformers.AutoConfig.from_pretrained(folder)
            arch = (loaded.architectures or ["CLIPTextModel"])[0]
            model = getattr(transformers, arch)(loaded)
    if hasattr(model, "tie_weights"):  # T5's and UMT5's encoder embedding is `shared`,
        model.tie_weights()  # tied by from_pretrained, not on the meta device
    return sum(p.numel() for p in model.parameters())


def model_shape(
    family: Family,
    model_dir: Path | None = None,
    *,
    recount: bool = False,
    denoiser: str | None = None,
    controls: int | None = None,
) -> ModelShape:
    """Count the UNet's parameters on the meta device: no memory, no download.

    A built-in family uses its stored counts unless `recount`. `denoiser`: the trained part's
    folder when it is not the family's first (Wan 2.2 A14B's `transformer_2`: EXPERTS).
    `controls`: the control images a target's activations are counted with (None: the
    family's own count, Spec.planned_controls).
    """
    config_path = unet_config_path(model_dir, denoiser) if model_dir else None
    spec = REGISTRY[family]
    if spec.flow:
        return _transformer_shape(
            family, model_dir, config_path, recount=recount, controls=controls
        )
    if config_path is None and not recount:
        params, largest = spec.builtin_counts
        native = int(spec.builtin_config["sample_size"]) * VAE_SCALE
        return ModelShape(
            family, params, largest, spec.frozen_params, native, f"built-in {family} config",
            text_width=int(spec.builtin_config["cross_attention_dim"]),
        )  # fmt: skip

    if config_path is not None and model_dir is not None:
        folder = config_path.parent
        stored, config = stored_counts(folder), stored_config(folder, UNET_KEYS)
        if stored and config:
            return _unet_shape(family, model_dir, config, *stored, str(config_path), frozen=True)

    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    if config_path is not None:
        config = UNet2DConditionModel.load_config(str(config_path.parent))
        source = str(config_path)
    else:
        config = spec.builtin_config
        source = f"built-in {family} config"
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(config)
    sizes = [p.numel() for p in unet.parameters()]
    frozen = config_path is not None and model_dir is not None
    return _unet_shape(family, model_dir, unet.config, sum(sizes), max(sizes), source,
                       frozen=frozen)  # fmt: skip


UNET_KEYS = ("sample_size", "block_out_channels", "cross_attention_dim")


def _unet_shape(
    family: Family,
    model_dir: Path | None,
    config: Any,
    params: int,
    largest: int,
    source: str,
    *,
    frozen: bool,
) -> ModelShape:
    """A UNet's ModelShape from its config and counts; `frozen`: count model_dir's frozen
    parts, else the family's published ones."""
    return ModelShape(
        family=family,
        denoiser_params=params,
        largest_param=largest,
        frozen_params=frozen_params(model_dir)
        if frozen and model_dir
        else REGISTRY[family].frozen_params,
        native_resolution=int(config["sample_size"]) * vae_scale(model_dir),
        source=source,
        base_channels=int(config["block_out_channels"][0]),
        vae_channels=_vae_channels(model_dir) if model_dir else 128,
        text_width=int(config["cross_attention_dim"]),
    )


def meta_model(family: str, model_dir: Path | None = None, denoiser: str | None = None) -> Any:
    """The trained model (UNet or transformer; `denoiser`: that folder's) on the meta device,
    from the model's own config when `model_dir` has one, else its family's built-in config:
    shapes, no weights. Shared (`built_on_meta`): read it; deepcopy it to change it."""
    cls = get(family).denoiser_class()
    path = unet_config_path(model_dir, denoiser) if model_dir else None
    config = cls.load_config(str(path.parent)) if path else REGISTRY[family].builtin_config
    return built_on_meta(cls, config)


def built_on_meta(cls: Any, config: dict[str, Any]) -> Any:
    """`cls` from `config` on the meta device, built once per class and config and then shared
    by every caller: a plan reads the model several times (counts, LoRA targets, adapter size,
    stored layers), and building a 14B transformer's modules takes seconds even without
    weights."""
    return _built_on_meta(cls, json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=4)  # a few models' modules; the meta device holds no storage
def _built_on_meta(cls: Any, config: str) -> Any:
    from accelerate import init_empty_weights

    # include_buffers: buffers on the meta device too, so none is computed (SD3's positional
    # table took 3.5 s of every plan; Wan's rotary tables 0.5 s)
    with init_empty_weights(include_buffers=True):
        return cls.from_config(json.loads(config))


def vae_scale(model_dir: Path | None) -> int:
    """Pixels per latent cell: 8 for the published VAEs, 2 for the tiny demo VAE."""
    config = model_dir / "vae" / "config.json" if model_dir else None
    if config is not None and config.is_file():
        vae = model_json(config)
        if "spatio_temporal_scaling" in vae:  # LTX-2's video VAE
            return ltx2_vae_scales(vae)[1]
        if "spatial_compression_ratio" in vae:  # HunyuanVideo 1.5's
            return int(vae["spatial_compression_ratio"])
        if "temperal_downsample" in vae:  # Qwen-Image's and Wan's video VAEs: one halving
            # per entry, after the 2x2 pixel patches of Wan 2.2's (`patch_size`: 16 in all)
            return 2 ** len(vae["temperal_downsample"]) * int(vae.get("patch_size") or 1)
        return 2 ** (len(vae["block_out_channels"]) - 1)
    return VAE_SCALE


def _vae_channels(model_dir: Path) -> int:
    config = model_dir / "vae" / "config.json"
    if not config.is_file():
        return 128
    return int(model_json(config).get("block_out_channels", [128])[0])


def _transformer_shape(
    family: Family,
    model_dir: Path | None,
    config_path: Path | None,
    *,
    recount: bool,
    controls: int | None = None,
) -> ModelShape:
    """model_shape of a flow-matching transformer (SD3's or Flux's), counted like a UNet,
    with its activations from its layers and width (`transformer_activations`), or measured per
    block (MEASURED_BLOCKS)."""
    spec = REGISTRY[family]
    native = spec.native_resolution  # SD3.5 and Flux.1 are trained at 1024 px, Wan at 480p
    frozen = frozen_params(model_dir) if model_dir and config_path else spec.frozen_params
    cls = get(family).denoiser_class()
    if config_path is not None:
        config, source = cls.load_config(str(config_path.parent)), str(config_path)
    else:
        config, source = spec.builtin_config, f"built-in {family} config"
    if config_path is None and not recount:
        params, largest = spec.builtin_counts
    else:
        sizes = [p.numel() for p in built_on_meta(cls, config).parameters()]
        params, largest = sum(sizes), max(sizes)
    streamed = spec.vae_params + spec.text_stream_params if spec.text_stream_params else None
    video = video_shape(family, config, model_dir) if spec.video else None
    # a cached caption token's states: several encoder layers' side by side (Krea 2's)
    text_layers = int(config[spec.text_layers_key]) if spec.text_layers_key else 1
    text_width = spec.caption_width or int(config[spec.text_width_key]) * text_layers
    return ModelShape(
        family, params, largest, frozen, native, source,
        activations_1024=transformer_activations(family, config, controls),
        text_width=text_width, caching_params=streamed, video=video,
        boundary_ratio=boundary_ratio(model_dir) if model_dir else None,
        blocks=MEASURED_BLOCKS[family](config) if family in MEASURED_BLOCKS else None,
    )  # fmt: skip


def boundary_ratio(model_dir: Path) -> float | None:
    """Wan 2.2 A14B's model_index.json `boundary_ratio` where it names a `transformer_2`
    (nan: it names none); None: a model with one denoiser."""
    index = model_dir / "model_index.json"
    components = model_json(index) if index.is_file() else {}
    if not has_experts(components):
        return None
    value = components.get("boundary_ratio")
    return float(value) if isinstance(value, int | float) else math.nan


def vae_latent_channels(model_dir: Path) -> int:
    """Channels of a latent cell: `latent_channels` (AutoencoderKL, FLUX.2's), or a video VAE's
    `z_dim` (Qwen-Image's, Wan's); 4 (SD's) without a config."""
    config = model_dir / "vae" / "config.json"
    vae = model_json(config) if config.is_file() else {}
    return int(vae.get("latent_channels") or vae.get("z_dim") or 4)


def video_scales(model_dir: Path | None) -> tuple[int, int]:
    """(frames, pixels) per latent cell of a video VAE: AutoencoderKLWan's
    `scale_factor_temporal` and `scale_factor_spatial` (what WanPipeline sizes latents by),
    else from its layers (`vae_scale`; a halving in time per true `temperal_downsample`), else
    Wan 2.1's defaults (4, 8)."""
    config = model_dir / "vae" / "config.json" if model_dir else None
    vae = model_json(config) if config is not None and config.is_file() else {}
    if "spatio_temporal_scaling" in vae:
        return ltx2_vae_scales(vae)
    if "temporal_compression_ratio" in vae:  # HunyuanVideo 1.5's AutoencoderKLHunyuanVideo15
        return int(vae["temporal_compression_ratio"]), int(vae["spatial_compression_ratio"])
    downsample = vae.get("temperal_downsample")
    temporal = vae.get("scale_factor_temporal") or (2 ** sum(map(bool, downsample))
                                                    if downsample else 4)  # fmt: skip
    spatial = vae.get("scale_factor_spatial") or (vae_scale(model_dir) if downsample else VAE_SCALE)
    return int(temporal), int(spatial)


def ltx2_vae_scales(vae: dict[str, Any]) -> tuple[int, int]:
    """(frames, pixels) per latent cell of AutoencoderKLLTX2Video's config: its
    `temporal_compression_ratio` and `spatial_compression_ratio` (LTX-2's 8 and 32), else as the
    class computes them (the patch sizes times a halving per `spatio_temporal_scaling`)."""
    scaling = vae.get("spatio_temporal_scaling", (True,) * 4)
    halvings = sum(map(bool, scaling)) if isinstance(scaling, list | tuple) else 3 * bool(scaling)
    temporal = (
        vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * 2**halvings
    )
    spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * 2**halvings
    return int(temporal), int(spatial)


def video_shape(family: str, config: dict[str, Any], model_dir: Path | None) -> VideoShape:
    """A video transformer's VideoShape from its config (Wan: WanTransformer3DModel's
    `patch_size`, `num_layers`, width and `ffn_dim`) and its VAE's (`video_scales`)."""
    spec = REGISTRY[family]
    temporal, spatial = video_scales(model_dir)
    vae_config = model_dir / "vae" / "config.json" if model_dir else None
    if "vae_scale_factors" in config and not (vae_config and vae_config.is_file()):
        temporal, spatial = (int(f) for f in config["vae_scale_factors"][:2])  # LTX-2's own
    if spec.transformer == "HunyuanVideo15Transformer3DModel" and not (
        vae_config and vae_config.is_file()
    ):
        temporal, spatial = HV15_VAE_SCALES
    heads = int(config["num_attention_heads"])
    width = math.prod(int(config[key]) for key in spec.width_keys)
    head_dim = width // heads
    joint: dict[str, int] = {}
    if spec.transformer == "HunyuanVideo15Transformer3DModel":
        per_token = HV15_TOKEN_WIDTH_BYTES * width + HV15_HEAD_BYTES * heads + HV15_TOKEN_BYTES
        text_tokens = spec.t5_tokens + HV15_JOINT_TEXT
        per_text = HV15_TOKEN_WIDTH_BYTES * width + HV15_HEAD_BYTES * heads + HV15_TEXT_BYTES
        side = int(config.get("patch_size", 1))
        patch = (int(config.get("patch_size_t", 1)), side, side)
        joint = {"joint_text": text_tokens, "pair_bytes": HV15_PAIR_BYTES,
                 "mask_bytes": HV15_MASK_BYTES}  # fmt: skip
        text_bytes = per_text * text_tokens
        channels = int(config.get("out_channels", 32))  # in: latents, condition and mask
    elif "patch_size_t" in config or "caption_channels" in config:  # LTX-2's: int patches
        per_token = LTX2_TOKEN_WIDTH_BYTES * width + LTX2_TOKEN_BYTES + LSE_BYTES * heads
        text_bytes = (LTX2_TEXT_WIDTH_BYTES * width + LTX2_TEXT_BYTES) * spec.t5_tokens
        channels = int(config.get("in_channels", 16))
        side = int(config.get("patch_size", 1))
        patch = (int(config.get("patch_size_t", 1)), side, side)
    else:
        per_token = (WAN_TOKEN_WIDTH_BYTES * width + WAN_TOKEN_FFN_BYTES * int(config["ffn_dim"])
                     + WAN_TOKEN_BYTES + LSE_BYTES * heads)  # fmt: skip
        text_bytes = (WAN_TEXT_WIDTH_BYTES * width + WAN_TEXT_BYTES) * spec.t5_tokens
        channels = int(config.get("in_channels", 16))
        patch = (int(config["patch_size"][0]), int(config["patch_size"][1]),
                 int(config["patch_size"][2]))  # fmt: skip
    return VideoShape(
        temporal=temporal, spatial=spatial, patch=patch,
        layers=sum(int(config[key]) for key in spec.layer_keys), token_bytes=per_token,
        input_bytes=2 * width, text_bytes=text_bytes, rope_bytes=2 * 4 * head_dim,
        latent_channels=channels, **joint,
    )  # fmt: skip


# Image transformers' activations measured per block (issue 47): Krea 2's and HiDream-I1's
# blocks (diffusers 0.42) in 16-bit, counted on the CPU as Wan's are (the tensors autograd saves,
# through torch.autograd.graph.saved_tensors_hooks, each storage once, less the parameters and the
# RoPE tables every layer shares; SDPA saving what a fused kernel saves, query, key, value and
# output, plus each head's fp32 logsumexp: HEAD_LSE_BYTES per query token), at several tiny
# widths, head counts and feed-forward sizes, the terms below fitting every count exactly
# (tests/test_plan_activations.py recounts them). A family names its function in
# MEASURED_BLOCKS; one without keeps Korthikanti's 34 x width (`transformer_activations`).
HEAD_LSE_BYTES = 4
# Krea 2's Krea2TransformerBlock, which text and image tokens pass alike: per token and layer
# 48 x width (its fp32 RMS norms' inputs and outputs, the modulations, the projections) + 8 x the
# key/value width (grouped-query attention: 12 key/value heads of 48, repeated before SDPA) +
# 8 x intermediate_size (the SwiGLU's gate, up, their product) + 4 per query and per key/value
# head (the q and k norms' fp32 statistic) + 8. At Krea 2's shapes (6144 wide, 1536 key/value,
# 16384 intermediate, 48 heads), with the logsumexp, 438,712 bytes a token and layer, 71 x width:
# 2.1x Korthikanti's.
KREA2_WIDTH_BYTES, KREA2_KV_WIDTH_BYTES, KREA2_FFN_BYTES = 48, 8, 8
KREA2_HEAD_BYTES, KREA2_TOKEN_BYTES = 4, 8
# Its text-fusion stage runs once per caption token, outside the checkpointed blocks: a
# Krea2TextFusionBlock is the block less its modulation (40 x width; keys and values as wide as
# the queries), run on every tapped layer's row (2 layerwise blocks x 12 rows) and then on the
# token (2 refiner blocks), 2560 wide; then the projector and txt_in: 10 x the text width +
# 4 x width + 4 (its fp32 norm's input, the projections'), less 2 x the text width + 4 per tapped
# layer (the projector's input is saved; the first block's fp32 input is not: the cached states
# need no gradient). 4.63 MB a caption token at Krea 2's shapes: 2.4 GB for its 512.
KREA2_FUSION_WIDTH_BYTES, KREA2_PROJECTION_TEXT_BYTES, KREA2_PROJECTION_WIDTH_BYTES = 40, 10, 4
KREA2_PROJECTION_BYTES, KREA2_LAYER_TEXT_BYTES, KREA2_LAYER_BYTES = 4, -2, -4
# HiDream-I1's HiDreamImageTransformerBlock (double-stream: the image's and the text's own
# projections, norms and feed-forwards, one joint attention) and HiDreamImageSingleTransformer-
# Block (the image and text tokens in one stream) save the same per image token, and the single
# block per text token too: 40 x width + 8 per hidden unit of the shared expert's SwiGLU + per
# routed expert a token goes to (num_activated_experts: 2 of 4; in training mode each gathers
# its tokens, `MOEFeedForwardSwiGLU`, so the experts together see tokens x 2 whatever the
# routing) 4 x width (its gathered input, its weighted output) + 8 per hidden unit + 10 (the
# router's weight and index) + 40. A double block's text token: 40 x width + 8 per hidden unit
# of its SwiGLU (ff_t) + 16. The SwiGLUs' hidden units: 2/3 of 4 x width (routed, text) or of
# 2 x width (shared), rounded up to 256 (`swiglu_hidden`). Each block sees 3 x 128 text tokens
# (T5's and Llama's last layer's, carried through the double blocks, and its own Llama
# layer's). At HiDream's shapes (2560 wide, 20 heads), with the logsumexp, 262,284 bytes an
# image token and block (102 x width) and 157,792 a double block's text token: 3x Korthikanti's.
HIDREAM_WIDTH_BYTES, HIDREAM_FFN_BYTES, HIDREAM_TOKEN_BYTES, HIDREAM_TEXT_BYTES = 40, 8, 40, 16
HIDREAM_EXPERT_WIDTH_BYTES, HIDREAM_EXPERT_BYTES = 4, 10


@dataclass(frozen=True)
class BlockKind:
    """One kind of a transformer's blocks: how many, the 16-bit bytes autograd saves in one per
    image token and per text token, and the text tokens each sees."""

    layers: int
    image_bytes: int
    text_bytes: int
    text_tokens: int

    def saved(self, image: int) -> int:
        return self.image_bytes * image + self.text_bytes * self.text_tokens


@dataclass(frozen=True)
class MeasuredBlocks:
    """A transformer's activations as measured per kind of block, plus what it saves once per
    caption token before them, outside the checkpointed blocks (Krea 2's text fusion)."""

    kinds: tuple[BlockKind, ...]
    width: int  # a block's input with checkpointing: 2 x width per token
    caption_tokens: int = 0
    caption_bytes: int = 0  # per caption token, once

    def at_resolution(self, resolution: int) -> tuple[int, int]:
        """`activations` of one image of resolution^2 pixels: a token per 2x2 latent cells."""
        return self.activations(resolution * resolution // (2 * VAE_SCALE) ** 2)

    def activations(self, image: int) -> tuple[int, int]:
        """(without, with checkpointing) bytes for `image` tokens: every block's saved tensors,
        or each block's inputs plus the biggest block recomputed."""
        once = self.caption_bytes * self.caption_tokens
        every = sum(kind.layers * kind.saved(image) for kind in self.kinds)
        inputs = sum(kind.layers * 2 * self.width * (image + kind.text_tokens)
                     for kind in self.kinds)  # fmt: skip
        return every + once, inputs + max(kind.saved(image) for kind in self.kinds) + once


def krea2_block(width: int, heads: int, kv_heads: int, ffn: int, *, modulated: bool) -> int:
    """Bytes a Krea 2 block (`modulated`) or text-fusion block saves per token."""
    width_bytes = KREA2_WIDTH_BYTES if modulated else KREA2_FUSION_WIDTH_BYTES
    return (width_bytes * width + KREA2_KV_WIDTH_BYTES * kv_heads * (width // heads)
            + KREA2_FFN_BYTES * ffn + KREA2_HEAD_BYTES * (heads + kv_heads) + KREA2_TOKEN_BYTES
            + HEAD_LSE_BYTES * heads)  # fmt: skip


def krea2_blocks(config: dict[str, Any]) -> MeasuredBlocks:
    """Krea 2's MeasuredBlocks from its config (Krea2Transformer2DModel's defaults, the
    published shapes, where it leaves a field out)."""

    def field(key: str, default: int) -> int:
        return int(config.get(key, default))

    heads = field("num_attention_heads", 48)
    width = heads * field("attention_head_dim", 128)
    kv_heads, ffn = field("num_key_value_heads", 12), field("intermediate_size", 16384)
    per_token = krea2_block(width, heads, kv_heads, ffn, modulated=True)
    text_width, text_heads = field("text_hidden_dim", 2560), field("text_num_attention_heads", 20)
    text_kv_heads = field("text_num_key_value_heads", 20)
    text_ffn = field("text_intermediate_size", 6912)
    fusion = krea2_block(text_width, text_heads, text_kv_heads, text_ffn, modulated=False)
    tapped = field("num_text_layers", 12)
    rows = field("num_layerwise_text_blocks", 2) * tapped + field("num_refiner_text_blocks", 2)
    caption = (rows * fusion + KREA2_PROJECTION_TEXT_BYTES * text_width
               + KREA2_PROJECTION_WIDTH_BYTES * width + KREA2_PROJECTION_BYTES
               + tapped * (KREA2_LAYER_TEXT_BYTES * text_width + KREA2_LAYER_BYTES))  # fmt: skip
    text = REGISTRY["krea2"].t5_tokens
    blocks = BlockKind(field("num_layers", 28), per_token, per_token, text)
    return MeasuredBlocks((blocks,), width, caption_tokens=text, caption_bytes=caption)


def swiglu_hidden(hidden: int) -> int:
    """HiDreamImageFeedForwardSwiGLU's hidden units for `hidden_dim`: 2/3 of it, rounded up to
    256."""
    return 256 * -(-int(2 * hidden / 3) // 256)


def hidream_blocks(config: dict[str, Any]) -> MeasuredBlocks:
    """HiDream-I1's MeasuredBlocks from its config."""
    heads = int(config.get("num_attention_heads", 20))
    width = heads * int(config.get("attention_head_dim", 128))
    routed, shared = swiglu_hidden(4 * width), swiglu_hidden(2 * width)
    attention = HIDREAM_WIDTH_BYTES * width + HEAD_LSE_BYTES * heads
    text_only = attention + HIDREAM_FFN_BYTES * routed + HIDREAM_TEXT_BYTES
    chosen = int(config.get("num_activated_experts", 2))
    expert = HIDREAM_EXPERT_WIDTH_BYTES * width + HIDREAM_FFN_BYTES * routed + HIDREAM_EXPERT_BYTES
    image = attention + HIDREAM_FFN_BYTES * shared + HIDREAM_TOKEN_BYTES + chosen * expert
    if not int(config.get("num_routed_experts", 4)):  # a plain SwiGLU, as the text's
        image = text_only
    text = 3 * REGISTRY["hidream"].t5_tokens
    double = BlockKind(int(config.get("num_layers", 16)), image, text_only, text)
    single = BlockKind(int(config.get("num_single_layers", 32)), image, image, text)
    return MeasuredBlocks((double, single), width)


MEASURED_BLOCKS: dict[str, Callable[[dict[str, Any]], MeasuredBlocks]] = {
    "krea2": krea2_blocks, "hidream": hidream_blocks,
}  # fmt: skip


def transformer_activations(
    family: str, config: dict[str, Any], controls: int | None = None
) -> tuple[int, int]:
    """(without, with checkpointing) bytes of a transformer's activations for one 1024 px
    image in 16-bit: per layer 34 x tokens x width without checkpointing (Korthikanti et al.,
    arXiv 2205.05198, with fused attention: no tokens^2 term), and with it the layer inputs
    (2 x tokens x width each) plus one layer recomputed. Tokens: the image's patches (2x2
    latent cells), once more per control image an edit family packs beside them (FLUX.1
    Kontext: its reference, at the target's size), and the text's (SD3: CLIP 77 + T5 256; Flux,
    Chroma: T5 512; Z-Image: Qwen3 512; Qwen-Image-Edit: Qwen2.5-VL 512 and its control
    image's 1369 vision tokens; Qwen-Image-Edit Plus: 3 references and their 201 each, the most
    it takes: the plan is made before the data are read; FLUX.2, whose references are optional:
    `controls`, as the data's file names tell, Spec.planned_controls). Layers: the family's
    `layer_keys`
    (Z-Image: its 30 main layers and the noise refiner's 2, which see the image; the context
    refiner's, on the text alone, are left out). A family in MEASURED_BLOCKS: its blocks'
    measured bytes."""
    spec = REGISTRY[family]
    references = spec.planned_controls(None) if controls is None else controls
    image = (1024 // VAE_SCALE // 2) ** 2 * (1 + references)
    if family in MEASURED_BLOCKS:
        return MEASURED_BLOCKS[family](config).at_resolution(1024)
    tokens = image + spec.clip_tokens + spec.t5_tokens + references * spec.control_text_tokens
    width = math.prod(int(config[key]) for key in spec.width_keys)
    layers = sum(int(config[key]) for key in spec.layer_keys)
    per_layer = 34 * tokens * width
    return layers * per_layer, layers * 2 * tokens * width + per_layer


def bucket_step(
    family: Family, model_dir: Path | None, *, resolution: int, denoiser: str | None = None
) -> int:
    """Pixels a bucket side is a multiple of: the one rule `check` and the ranks both call. A
    side must survive the VAE's downsampling and the denoiser's (the UNet's levels, a
    transformer's patches: the family's `latent_multiple`, read off the model's own config, else
    its built-in one); from 512 px up an image family's buckets step by 64 px at least (the
    buckets SDXL and its peers train), a video family keeps its own (Wan's 832x480 is a multiple
    of 16, not of 64). The one function here that imports the family's trainer (torch): its
    `latent_multiple` says the denoiser's rule, and both callers have torch loaded already."""
    import inspect
    from types import SimpleNamespace

    trainer = get(family)
    path = unet_config_path(model_dir, denoiser) if model_dir else None
    config = model_json(path) if path else REGISTRY[family].builtin_config
    try:  # save_pretrained writes every field: no need to import the class (seconds in `check`)
        cells = trainer.latent_multiple(SimpleNamespace(**config))
    except AttributeError:  # a field left out takes the class's default, as diffusers reads it
        init = inspect.signature(trainer.denoiser_class().__init__).parameters.values()
        defaults = {p.name: p.default for p in init if p.default is not inspect.Parameter.empty}
        cells = trainer.latent_multiple(SimpleNamespace(**{**defaults, **config}))
    step = vae_scale(model_dir) * cells
    return max(step, 64) if resolution >= 512 and not REGISTRY[family].video else step
