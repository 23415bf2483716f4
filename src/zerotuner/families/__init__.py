"""Model families: the UNet families (SDXL, SD 1.x, SD 2.x) and the flow-matching transformer
families (SD3 / SD3.5, Flux.1, Chroma, Z-Image, Qwen-Image, FLUX.2 [dev] and [klein], Wan). This
package's root knows what the planner and the normalizer need before any weights exist:
detection from a pipeline's files, built-in configs and parameter shapes (the trained model is
built on the meta device, `accelerate.init_empty_weights`, from a local config or from its
family's built-in one, so planning works on a laptop with nothing downloaded). Each family is
one `Spec` in REGISTRY, the torch-free facts every table here derives from, and one module
behind `base.ModelFamily` with what it is to the trainer: `get(name)`. The loop, checkpoints,
export and the planner never name a family.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.families.stored import model_json, stored_config, stored_counts
from zerotuner.settings.family_names import FAMILIES


@dataclass(frozen=True)
class Spec:
    """A family's facts that need no torch: where its trainer lives, how a pipeline's files and
    a hub id name it, its published model's config and sizes, and what a cached caption holds.
    A new family is its module (one `base.ModelFamily` subclass) and one entry in REGISTRY."""

    module: str  # zerotuner/families/<module>.py
    cls: str  # the ModelFamily subclass there
    # The published model's config (fields that differ from its class's defaults) and its
    # (parameters, largest tensor), counted once on the meta device (tests/test_plan.py
    # recounts them): building SDXL on the meta device costs seconds.
    builtin_config: dict[str, Any]
    builtin_counts: tuple[int, int]
    text_params: int  # its text encoders' parameters (frozen: the planner counts them apart)
    vae_params: int
    flow: bool = False  # a transformer trained by flow matching
    pipeline: str = ""  # the model_index.json `_class_name` that names it
    transformer: str = ""  # its transformer's `_class_name` (a folder without model_index.json)
    hub_markers: tuple[str, ...] = ()  # parts of a hub id's name that say it
    guess_order: int = 0  # lower is tried first: markers that others' names contain go last
    clip_tokens: int = 77  # CLIP tokens in a cached caption's states
    # T5 tokens in them (Z-Image: its Qwen3 encoder's), the pipeline's max_sequence_length
    t5_tokens: int = 0
    # the encoder those tokens are states of, as the plan names it (lower-cased: as the cached
    # captions' key does)
    long_encoder: str = "T5"
    # Text encoder parameters on the device while caching where the encoder streams from host
    # memory layer by layer (FLUX.2 [dev]'s 24B Mistral: its largest layer); 0: it loads whole.
    text_stream_params: int = 0
    layer_keys: tuple[str, ...] = ()  # a transformer's config fields that count its blocks
    # a transformer's config fields whose product is its width, and the one naming the width of
    # the text states it takes
    width_keys: tuple[str, ...] = ("num_attention_heads", "attention_head_dim")
    text_width_key: str = "joint_attention_dim"
    # A video family (Wan) trains clips of ZT_VIDEO_FRAMES frames: the planner counts frames x
    # tokens (`VideoShape`) and the frame rule (`frames = temporal * k + 1`) is checked.
    video: bool = False
    # The side of the square whose area it plans for (ZT_RESOLUTION's default, the area side
    # buckets are cut at): 1024 px; Wan's 480p, 832 x 480 (399,360 px), fits in 632^2.
    native_resolution: int = 1024

    @property
    def frozen_params(self) -> int:
        return self.text_params + self.vae_params


CLIP_L, CLIP_G, CLIP_G_SD3 = 123_060_480, 694_659_840, 123_650_304 + 694_659_840
T5_XXL_PARAMS = 4_762_310_656  # the encoder of google/t5-v1_1-xxl
QWEN3_4B_PARAMS = 4_022_468_096  # Qwen3Model of Qwen/Qwen3-4B's config (Z-Image's text encoder)
QWEN25_VL_7B_PARAMS = 8_292_166_656  # Qwen2_5_VLForConditionalGeneration, Qwen2.5-VL-7B's config
QWEN_VAE_PARAMS = 126_892_531  # AutoencoderKLQwenImage (Qwen-Image's video VAE)
# Mistral3ForConditionalGeneration of mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json
# (FLUX.2 [dev]'s text encoder is 3.2-24B-Instruct-2506, the same shapes; diffusers'
# scripts/convert_flux2_to_diffusers.py); vision fields the page leaves out at PixtralVisionConfig's
# defaults. Its largest layer: the token embedding (and lm_head), 131072 x 5120.
MISTRAL_SMALL_3_PARAMS, MISTRAL_SMALL_3_LAYER = 24_011_361_280, 671_088_640
FLUX2_VAE_PARAMS = 84_046_115  # AutoencoderKLFlux2's defaults
# UMT5EncoderModel of google/umt5-xxl's config (Wan's text encoder: d_model 4096, 24 layers,
# vocabulary 256384), its token embedding counted once (`encoder.embed_tokens` is `shared`)
UMT5_XXL_PARAMS = 5_680_910_336
WAN_VAE_PARAMS = 126_892_531  # AutoencoderKLWan's defaults, Wan 2.1's VAE (Qwen-Image's network)
VAE_PARAMS = 83_653_863  # the SD 1.x/2.x/XL VAE
VAE16_PARAMS = 83_819_683  # SD3's and Flux's 16-channel VAE
VAE_SCALE = 8  # pixels per latent cell in every family's VAE

# The published models: stabilityai/stable-diffusion-xl-base-1.0, runwayml/stable-diffusion-v1-5,
# stabilityai/stable-diffusion-2-1, stabilityai/stable-diffusion-3.5-large, black-forest-labs/
# FLUX.1-dev, lodestones/Chroma1-HD (its transformer/config.json is ChromaTransformer2DModel's
# defaults: 8.90B, the card's "8.9B"; T5-XXL and FLUX.1's VAE), Tongyi-MAI/Z-Image-Turbo
# (transformer/config.json: 6.15B, the card's "6B"; Qwen3-4B as its text encoder, FLUX.1's VAE),
# Qwen/Qwen-Image (transformer/config.json: 20.43B, the card's "20B"; Qwen2.5-VL-7B's 8.29B),
# black-forest-labs/FLUX.2-dev and FLUX.2-klein-4B (their transformer configs as diffusers'
# scripts/convert_flux2_to_diffusers.py writes them, dev's Flux2Transformer2DModel's defaults:
# 32.22B and 3.88B, the cards' "32B" and "4B"; Mistral Small 3.x 24B and Qwen3-4B),
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers (the transformer config diffusers'
# scripts/convert_wan_to_diffusers.py writes for Wan-T2V-1.3B: 1.42B, the card's "1.3B"; UMT5-XXL).
REGISTRY: dict[str, Spec] = {
    "sdxl": Spec(
        "unet", "SDXL",
        {
            "sample_size": 128,
            "block_out_channels": [320, 640, 1280],
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "transformer_layers_per_block": [1, 2, 10],
            "attention_head_dim": [5, 10, 20],
            "cross_attention_dim": 2048,
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
        },
        (2_567_463_684, 29_491_200), CLIP_L + CLIP_G, VAE_PARAMS,
        hub_markers=("xl",), guess_order=2,
    ),
    "sd1": Spec(
        "unet", "StableDiffusion",
        {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8},
        (859_520_964, 29_491_200), CLIP_L, VAE_PARAMS,
        hub_markers=("stable-diffusion-v1", "sd1", "v1"), guess_order=4,
    ),
    "sd2": Spec(
        "unet", "StableDiffusion",
        {"sample_size": 96, "cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20],
         "use_linear_projection": True},
        (865_910_724, 29_491_200), 340_387_840, VAE_PARAMS,  # OpenCLIP ViT-H
        hub_markers=("stable-diffusion-2", "sd2", "-2", "v2"), guess_order=3,
    ),
    "sd3": Spec(
        "flow", "SD3",
        {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
         "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
         "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
         "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
        (8_056_627_520, 35_487_744), CLIP_G_SD3 + T5_XXL_PARAMS, VAE16_PARAMS,
        flow=True, pipeline="StableDiffusion3Pipeline", transformer="SD3Transformer2DModel",
        hub_markers=("stable-diffusion-3", "sd3"), guess_order=1, t5_tokens=256,
        layer_keys=("num_layers",),
    ),
    "flux": Spec(
        "flow", "Flux",
        {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
         "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
         "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
        (11_901_408_320, 56_623_104), CLIP_L + T5_XXL_PARAMS, VAE16_PARAMS,
        flow=True, pipeline="FluxPipeline", transformer="FluxTransformer2DModel",
        hub_markers=("flux",), guess_order=0, clip_tokens=0, t5_tokens=512,
        layer_keys=("num_layers", "num_single_layers"),
    ),
    "chroma": Spec(
        "chroma", "Chroma",
        {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
         "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
         "axes_dims_rope": [16, 56, 56], "approximator_num_channels": 64,
         "approximator_hidden_dim": 5120, "approximator_layers": 5},
        (8_899_983_424, 47_185_920), T5_XXL_PARAMS, VAE16_PARAMS,
        flow=True, pipeline="ChromaPipeline", transformer="ChromaTransformer2DModel",
        hub_markers=("chroma",), guess_order=-1, clip_tokens=0, t5_tokens=512,
        layer_keys=("num_layers", "num_single_layers"),
    ),
    "zimage": Spec(
        "z_image", "ZImage",
        {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840,
         "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
         "norm_eps": 1e-05, "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0,
         "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512]},
        (6_154_908_736, 39_321_600), QWEN3_4B_PARAMS, VAE16_PARAMS,
        flow=True, pipeline="ZImagePipeline", transformer="ZImageTransformer2DModel",
        hub_markers=("z-image", "z_image", "zimage"), guess_order=-1, clip_tokens=0,
        t5_tokens=512, long_encoder="Qwen3", layer_keys=("n_layers", "n_refiner_layers"),
        width_keys=("dim",), text_width_key="cap_feat_dim",
    ),
    "qwenimage": Spec(
        "qwen_image", "QwenImage",
        {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
         "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
         "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
        (20_430_401_088, 56_623_104), QWEN25_VL_7B_PARAMS, QWEN_VAE_PARAMS,
        flow=True, pipeline="QwenImagePipeline", transformer="QwenImageTransformer2DModel",
        hub_markers=("qwen-image", "qwen_image", "qwenimage"), guess_order=-1, clip_tokens=0,
        t5_tokens=512, long_encoder="Qwen2.5-VL", layer_keys=("num_layers",),
    ),
    "flux2": Spec(
        "flux2", "Flux2",
        {"patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48,
         "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360},
        (32_223_281_152, 339_738_624), MISTRAL_SMALL_3_PARAMS, FLUX2_VAE_PARAMS,
        flow=True, pipeline="Flux2Pipeline", transformer="Flux2Transformer2DModel",
        hub_markers=("flux.2", "flux2", "flux-2"), guess_order=-2, clip_tokens=0,
        t5_tokens=512, long_encoder="Mistral", text_stream_params=MISTRAL_SMALL_3_LAYER,
        layer_keys=("num_layers", "num_single_layers"),
    ),
    "flux2klein": Spec(
        "flux2", "Flux2Klein",
        {"patch_size": 1, "in_channels": 128, "num_layers": 5, "num_single_layers": 20,
         "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
         "guidance_embeds": False},
        (3_875_544_576, 84_934_656), QWEN3_4B_PARAMS, FLUX2_VAE_PARAMS,
        flow=True, pipeline="Flux2KleinPipeline", transformer="Flux2Transformer2DModel",
        hub_markers=("flux.2-klein", "flux2-klein", "flux-2-klein", "flux2klein"),
        guess_order=-3, clip_tokens=0, t5_tokens=512, long_encoder="Qwen3",
        layer_keys=("num_layers", "num_single_layers"),
    ),
    "wan": Spec(
        "wan", "Wan",
        {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
         "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
         "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
         "qk_norm": "rms_norm_across_heads", "eps": 1e-06},
        (1_418_996_800, 14_155_776), UMT5_XXL_PARAMS, WAN_VAE_PARAMS,
        flow=True, pipeline="WanPipeline", transformer="WanTransformer3DModel",
        hub_markers=("wan-ai/", "wan2", "wan-2", "wan_2"), guess_order=-1, clip_tokens=0,
        t5_tokens=512, long_encoder="UMT5", layer_keys=("num_layers",), text_width_key="text_dim",
        video=True, native_resolution=632,
    ),
}  # fmt: skip
Family = str  # a key of REGISTRY
if tuple(REGISTRY) != FAMILIES:  # settings.py takes the names from family_names, below this
    raise ImportError(f"family_names.FAMILIES {FAMILIES} is not REGISTRY's keys {tuple(REGISTRY)}")
FLOW_FAMILIES = tuple(f for f, spec in REGISTRY.items() if spec.flow)
PIPELINES = {spec.pipeline: f for f, spec in REGISTRY.items() if spec.pipeline}
TRANSFORMERS: dict[str, str] = {}  # a class's first family; FLUX.2's two: transformer_family
for _family, _spec in REGISTRY.items():
    if _spec.transformer:
        TRANSFORMERS.setdefault(_spec.transformer, _family)


def get(name: str) -> Any:
    """The family's `base.ModelFamily` (its module imported on first use: planning needs no
    torch)."""
    import importlib

    if name not in REGISTRY:
        raise ConfigError(f"ZT_MODEL_FAMILY={name}: expected one of {', '.join(FAMILIES)}")
    spec = REGISTRY[name]
    return getattr(importlib.import_module(f"zerotuner.families.{spec.module}"), spec.cls)(name)


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

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.temporal + 1

    def tokens(self, frames: int, resolution: int) -> int:
        cell = self.spatial * self.spatial * self.patch[1] * self.patch[2]
        return -(-self.latent_frames(frames) // self.patch[0]) * (resolution * resolution // cell)

    def activations(self, tokens: int, checkpointing: bool) -> int:
        """16-bit bytes for `tokens`: every layer's saved tensors, or with checkpointing each
        block's input (its hidden states: 2 x width per token) plus one block recomputed."""
        layer = self.token_bytes * tokens + self.text_bytes
        kept = (
            self.layers * self.input_bytes * tokens + layer
            if checkpointing
            else self.layers * layer
        )
        return kept + self.rope_bytes * tokens


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
    # checkpointing); None: a UNet's, scaled from DESIGN.md's SDXL figure by base_channels.
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


def caption_cache_bytes(shape: ModelShape, max_sequence_length: int | None = None) -> int:
    """Disk bytes of one caption's cached text states: CLIP's 77 tokens in fp32 for the UNet
    families; a flow family's CLIP and T5 tokens in bf16 (T5-XXL is 4096 wide)."""
    spec = REGISTRY[shape.family]
    if not spec.flow:
        return spec.clip_tokens * shape.text_width * 4
    return (spec.clip_tokens + (max_sequence_length or spec.t5_tokens)) * shape.text_width * 2


# A hub model's files the planner reads (a few KB): the pipeline index and each part's config.
HUB_CONFIG_FILES = ("model_index.json", "*/config.json")


def hub_cache_dir(cache_dir: Path) -> Path:
    """Where hub downloads go: HF_HOME's hub folder, else ZT_CACHE_DIR/huggingface/hub."""
    return Path(os.environ.get("HF_HOME") or cache_dir / "huggingface") / "hub"


def detect_family(model_dir: Path, expert: str | None = None) -> Family:
    """SDXL has a second text encoder and `text_time` conditioning; SD2 attends with 1024 dims.
    `expert`: ZT_EXPERT (Wan 2.2 A14B is refused without it)."""
    index = model_dir / "model_index.json"
    if index.is_file():
        components = model_json(index)
        pipeline = str(components.get("_class_name", ""))
        refuse_edit_model(model_dir, pipeline)
        refuse_wan_variant(model_dir, pipeline, components, expert)
        if pipeline in PIPELINES:
            return PIPELINES[pipeline]  # type: ignore[return-value]
        foreign = pipeline and not pipeline.startswith("StableDiffusion")
        if foreign or "transformer" in components or "unet" not in components and pipeline:
            raise ConfigError(
                f"ZT_MODEL={model_dir}: a {pipeline or 'transformer'} pipeline; zerotuner "
                f"trains {', '.join(FAMILIES)} pipelines ({', '.join(PIPELINES)} and the "
                "Stable Diffusion 1.x/2.x/XL ones)"
            )
        if "text_encoder_2" in components or "XL" in pipeline:
            return "sdxl"
    config = unet_config_path(model_dir)
    if config is None:
        raise ConfigError(
            f"ZT_MODEL={model_dir}: no model_index.json or unet/config.json; "
            f"set ZT_MODEL_FAMILY to one of {', '.join(FAMILIES)}"
        )
    unet = model_json(config)
    name = unet.get("_class_name", "")
    refuse_wan_variant(model_dir, name, unet)
    if name in TRANSFORMERS:  # a transformer without its pipeline's model_index.json
        return transformer_family(name, unet)
    if "Transformer" in name:
        raise ConfigError(
            f"ZT_MODEL={model_dir}: a {name} model; zerotuner trains the "
            f"{', '.join(TRANSFORMERS)} transformers and the UNets of "
            f"{', '.join(f for f, spec in REGISTRY.items() if not spec.flow)}"
        )
    if unet.get("addition_embed_type") == "text_time":
        return "sdxl"
    return "sd2" if unet.get("cross_attention_dim") == 1024 else "sd1"


def transformer_family(name: str, config: dict[str, Any]) -> Family:
    """The family of a transformer config of class `name`: FLUX.2 [klein] shares [dev]'s
    class and has no guidance embedding."""
    if name == "Flux2Transformer2DModel" and not config.get("guidance_embeds", True):
        return "flux2klein"
    return TRANSFORMERS[name]


def unet_config_path(model_dir: Path, denoiser: str | None = None) -> Path | None:
    """The trained model's config: the UNet's, or a transformer family's transformer's (or
    the `denoiser` folder's: Wan 2.2 A14B's chosen expert, `transformer_2`)."""
    parts = (denoiser,) if denoiser else ("unet", "transformer")
    candidates = [model_dir / part / "config.json" for part in parts]
    for candidate in (*candidates, model_dir / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def resolve_family(model: str, family_setting: str = "auto", expert: str | None = None) -> Family:
    """ZT_MODEL_FAMILY, else read from a local folder, else guessed from a hub id's name.
    `expert`: ZT_EXPERT (Wan 2.2 A14B is refused without it)."""
    if family_setting != "auto":
        if family_setting not in FAMILIES:
            raise ConfigError(
                f"ZT_MODEL_FAMILY={family_setting}: expected auto, {', '.join(FAMILIES)}"
            )
        return family_setting  # type: ignore[return-value]
    path = Path(model)
    if path.is_dir():
        return detect_family(path, expert)
    family = guess_family(model, expert)
    if family is None:
        raise ConfigError(
            f"ZT_MODEL={model}: cannot tell the model family from the name; set ZT_MODEL_FAMILY "
            f"to one of {', '.join(FAMILIES)}"
        )
    return family


# Pipelines (and hub names) of image-edit models: they train on (source, target) image pairs.
EDIT_MARKERS = ("edit", "kontext")


def refuse_edit_model(model: Any, name: str) -> None:
    """An image-edit model (Qwen-Image-Edit, FLUX.1 Kontext: a pipeline or hub name that says
    so; FLUX.2 with reference images) is one line, exit 2, naming what zerotuner trains."""
    import re

    flux2 = any(m in name.lower() for m in REGISTRY["flux2"].hub_markers)
    flux2 = " (FLUX.2 trains here on text and image alone, without reference images)" * flux2
    supported = (f"zerotuner trains text-to-image models from captioned images: "
                 f"{', '.join(FAMILIES)}")  # fmt: skip
    # words of a class or hub name: QwenImageEditPipeline, Qwen-Image-Edit-2509 (not "credit")
    words = {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name)}
    if words & set(EDIT_MARKERS):
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is an image-edit model, trained on paired (source, "
            f"edited) images, which zerotuner does not take{flux2}; {supported}"
        )


# Wan's image- or video-conditioned variants, as their hub names say them (Wan2.1-I2V-14B-480P,
# Wan2.1-FLF2V-14B-720P, Wan2.1-VACE-1.3B, Wan2.2-Animate-14B, Wan2.2-S2V-14B)
WAN_CONDITIONED = ("i2v", "flf2v", "vace", "animate", "s2v", "v2v")
WAN_SUPPORTED = ("zerotuner trains Wan's text-to-video models (WanPipeline: Wan 2.1 T2V 1.3B "
                 "and 14B, Wan 2.2 TI2V-5B, and Wan 2.2 T2V A14B one expert per run with "
                 "ZT_EXPERT) on captioned clips and images")  # fmt: skip
# ZT_EXPERT: the pipeline folder (and WanPipeline attribute) of each of A14B's experts. WanPipeline
# (diffusers 0.42, pipelines/wan/pipeline_wan.py) runs `transformer` at the timesteps t >=
# boundary_ratio * num_train_timesteps (the noisy ones), `transformer_2` below.
EXPERTS = {"high": "transformer", "low": "transformer_2"}


def expert_range(expert: str, boundary: float) -> tuple[float, float]:
    """The part of the noise schedule (sigmas, 0 clean to 1 noise) an expert denoises."""
    return (boundary, 1.0) if expert == "high" else (0.0, boundary)


def expert_sigmas(settings: Any, boundary: float | None) -> tuple[float, float]:
    """The sigmas a run of ZT_EXPERT trains: the expert's part of the schedule, or the
    ZT_TIMESTEP_RANGE inside it; one line, exit 2, for a boundary WanPipeline never uses or a
    range outside the expert's."""
    from zerotuner.settings.schema import env_name, timestep_bounds

    expert = settings.expert
    if boundary is None or math.isnan(boundary) or not 0 < boundary < 1:
        raise ConfigError(
            f"{env_name('expert')}={expert}: the model's model_index.json names a "
            f"transformer_2 but no boundary_ratio between 0 and 1 ({boundary}), so WanPipeline "
            f"never runs one of the experts; give it the boundary_ratio it was trained with"
        )
    low, high = expert_range(expert, boundary)
    if settings.timestep_range is None:
        return low, high
    want = timestep_bounds(settings.timestep_range)
    if not low <= want[0] < want[1] <= high:
        raise ConfigError(
            f"{env_name('timestep_range')}={settings.timestep_range}: outside the {expert}-noise "
            f"expert's part of the schedule ({EXPERTS[expert]}: {low:g}-{high:g}, the model's "
            f"boundary_ratio {boundary:g}); give a range inside it, or unset it to train all of it"
        )
    return want


def has_experts(config: dict[str, Any]) -> bool:
    """A model_index.json naming a `transformer_2` (Wan 2.2 A14B; TI2V-5B's is null)."""
    expert = config.get("transformer_2") or [None]
    return isinstance(expert, list) and bool(expert) and bool(expert[0])


def refuse_wan_variant(
    model: Any, name: str, config: dict[str, Any] | None = None, expert: str | None = None
) -> None:
    """A Wan model other than a text-to-video transformer is one line, exit 2: Wan 2.2 A14B's
    two experts (a `transformer_2` in model_index.json, `A14B` in a hub name) without
    ZT_EXPERT (`expert`), and the image- or video-conditioned ones (WanImageToVideoPipeline,
    WanVACEPipeline...; `I2V`, `VACE`... in a hub name; a WanTransformer3DModel whose input has
    more channels than its output)."""
    import re

    config = config or {}
    lowered = name.lower()
    if not name.startswith("Wan") and not any(m in lowered for m in REGISTRY["wan"].hub_markers):
        return
    words = set(re.split(r"[^a-z0-9]+", lowered))
    pipeline = name.endswith("Pipeline") and name != REGISTRY["wan"].pipeline
    inputs = config.get("in_channels")  # I2V's transformer takes the image's latents too
    channels = inputs is not None and inputs != config.get("out_channels", inputs)
    if pipeline or words & set(WAN_CONDITIONED) or channels:
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is an image- or video-conditioned Wan model (image-to-"
            f"video, first-last-frame, VACE, animate), trained on conditioning frames, which "
            f"zerotuner does not take; {WAN_SUPPORTED}"
        )
    if ("a14b" in words or has_experts(config)) and not expert:
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is Wan 2.2 A14B, two expert transformers (transformer "
            f"for the noisy steps, transformer_2 for the clean ones, split at its "
            f"boundary_ratio): set ZT_EXPERT=high or ZT_EXPERT=low to train one of them (one "
            f"expert per run: two runs train both; the export is a WanPipeline folder with the "
            f"other expert unchanged)"
        )


def guess_family(hub_id: str, expert: str | None = None) -> Family | None:
    """The family a hub id's name says (when its configs cannot be read), or None; an
    image-edit model's name is refused (refuse_edit_model), as a Wan variant's
    (refuse_wan_variant; `expert`: ZT_EXPERT)."""
    refuse_edit_model(hub_id, hub_id.rsplit("/", 1)[-1])
    refuse_wan_variant(hub_id, hub_id, expert=expert)
    name = hub_id.lower()
    for family, spec in sorted(REGISTRY.items(), key=lambda item: item[1].guess_order):
        if any(marker in name for marker in spec.hub_markers):
            return family
    return None


def frozen_params(
    model_dir: Path,
    parts: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"),
) -> int:
    """Parameters of the text encoders and VAE (or `parts`) of a local pipeline, from their
    safetensors headers, else counted on the meta device."""
    from accelerate import init_empty_weights

    total = 0
    for sub in parts:
        folder = model_dir / sub
        if not (folder / "config.json").is_file():
            continue
        if stored := stored_counts(folder):
            total += stored[0]
            continue
        with init_empty_weights():
            if sub == "vae":
                import diffusers

                index = model_dir / "model_index.json"  # Qwen-Image's is another class
                named = model_json(index).get("vae") if index.is_file() else None
                cls = getattr(diffusers, named[1] if named else "AutoencoderKL")
                module = cls.from_config(cls.load_config(str(folder)))
            else:
                import transformers

                config = transformers.AutoConfig.from_pretrained(str(folder))
                arch = (config.architectures or ["CLIPTextModel"])[0]
                module = getattr(transformers, arch)(config)
        if hasattr(module, "tie_weights"):  # T5's and UMT5's encoder embedding is `shared`,
            module.tie_weights()  # tied by from_pretrained, not on the meta device
        total += sum(p.numel() for p in module.parameters())
    return total


def model_shape(
    family: Family,
    model_dir: Path | None = None,
    *,
    recount: bool = False,
    denoiser: str | None = None,
) -> ModelShape:
    """Count the UNet's parameters on the meta device: no memory, no download.

    A built-in family uses its stored counts unless `recount`. `denoiser`: the trained part's
    folder when it is not the family's first (Wan 2.2 A14B's `transformer_2`: EXPERTS).
    """
    config_path = unet_config_path(model_dir, denoiser) if model_dir else None
    spec = REGISTRY[family]
    if spec.flow:
        return _transformer_shape(family, model_dir, config_path, recount=recount)
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
    shapes, no weights."""
    from accelerate import init_empty_weights

    cls = get(family).denoiser_class()
    path = unet_config_path(model_dir, denoiser) if model_dir else None
    config = cls.load_config(str(path.parent)) if path else REGISTRY[family].builtin_config
    with init_empty_weights():
        return cls.from_config(config)


def vae_scale(model_dir: Path | None) -> int:
    """Pixels per latent cell: 8 for the published VAEs, 2 for the tiny demo VAE."""
    config = model_dir / "vae" / "config.json" if model_dir else None
    if config is not None and config.is_file():
        vae = model_json(config)
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
    family: Family, model_dir: Path | None, config_path: Path | None, *, recount: bool
) -> ModelShape:
    """model_shape of a flow-matching transformer (SD3's or Flux's), counted like a UNet,
    with its activations from its layers and width (`transformer_activations`)."""
    spec = REGISTRY[family]
    native = spec.native_resolution  # SD3.5 and Flux.1 are trained at 1024 px, Wan at 480p
    frozen = frozen_params(model_dir) if model_dir and config_path else spec.frozen_params
    if config_path is None and not recount:
        params, largest = spec.builtin_counts
        source = f"built-in {family} config"
    else:
        from accelerate import init_empty_weights

        cls = get(family).denoiser_class()
        if config_path is not None:
            config, source = cls.load_config(str(config_path.parent)), str(config_path)
        else:
            config, source = spec.builtin_config, f"built-in {family} config"
        with init_empty_weights():
            model = cls.from_config(config)
        sizes = [p.numel() for p in model.parameters()]
        params, largest = sum(sizes), max(sizes)
    config = (
        get(family).denoiser_class().load_config(str(config_path.parent))
        if config_path is not None
        else spec.builtin_config
    )
    streamed = spec.vae_params + spec.text_stream_params if spec.text_stream_params else None
    video = video_shape(family, config, model_dir) if spec.video else None
    return ModelShape(
        family, params, largest, frozen, native, source,
        activations_1024=transformer_activations(family, config),
        text_width=int(config[spec.text_width_key]), caching_params=streamed, video=video,
        boundary_ratio=boundary_ratio(model_dir) if model_dir else None,
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
    downsample = vae.get("temperal_downsample")
    temporal = vae.get("scale_factor_temporal") or (2 ** sum(map(bool, downsample))
                                                    if downsample else 4)  # fmt: skip
    spatial = vae.get("scale_factor_spatial") or (vae_scale(model_dir) if downsample else VAE_SCALE)
    return int(temporal), int(spatial)


def video_shape(family: str, config: dict[str, Any], model_dir: Path | None) -> VideoShape:
    """A video transformer's VideoShape from its config (Wan: WanTransformer3DModel's
    `patch_size`, `num_layers`, width and `ffn_dim`) and its VAE's (`video_scales`)."""
    spec = REGISTRY[family]
    temporal, spatial = video_scales(model_dir)
    heads = int(config["num_attention_heads"])
    width = math.prod(int(config[key]) for key in spec.width_keys)
    head_dim = width // heads
    per_token = (WAN_TOKEN_WIDTH_BYTES * width + WAN_TOKEN_FFN_BYTES * int(config["ffn_dim"])
                 + WAN_TOKEN_BYTES + LSE_BYTES * heads)  # fmt: skip
    return VideoShape(
        temporal=temporal, spatial=spatial, patch=tuple(int(p) for p in config["patch_size"]),
        layers=sum(int(config[key]) for key in spec.layer_keys), token_bytes=per_token,
        input_bytes=2 * width,
        text_bytes=(WAN_TEXT_WIDTH_BYTES * width + WAN_TEXT_BYTES) * spec.t5_tokens,
        rope_bytes=2 * 4 * head_dim, latent_channels=int(config.get("in_channels", 16)),
    )  # fmt: skip


def transformer_activations(family: str, config: dict[str, Any]) -> tuple[int, int]:
    """(without, with checkpointing) bytes of a transformer's activations for one 1024 px
    image in 16-bit: per layer 34 x tokens x width without checkpointing (Korthikanti et al.,
    arXiv 2205.05198, with fused attention: no tokens^2 term), and with it the layer inputs
    (2 x tokens x width each) plus one layer recomputed. Tokens: the image's patches (2x2
    latent cells) and the text's (SD3: CLIP 77 + T5 256; Flux, Chroma: T5 512; Z-Image: Qwen3
    512). Layers: the family's `layer_keys` (Z-Image: its 30 main layers and the noise refiner's
    2, which see the image; the context refiner's, on the text alone, are left out)."""
    spec = REGISTRY[family]
    tokens = (1024 // VAE_SCALE // 2) ** 2 + spec.clip_tokens + spec.t5_tokens
    width = math.prod(int(config[key]) for key in spec.width_keys)
    layers = sum(int(config[key]) for key in spec.layer_keys)
    per_layer = 34 * tokens * width
    return layers * per_layer, layers * 2 * tokens * width + per_layer


UNET_SETTINGS = ("prediction_type", "snr_gamma", "noise_offset")  # DDPM's
FLOW_SETTINGS = (
    "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "train_guidance",
    "max_sequence_length",
)  # fmt: skip


VIDEO_SETTINGS = ("video_frames", "video_fps")


def check_family_settings(settings: Any, family: str, shape: ModelShape | None = None) -> None:
    """A setting of the other objective (a UNet's DDPM, a transformer's flow matching), or
    one the family cannot do yet, is one line, exit 2: a video setting for an image family, or
    a clip length a video family's VAE cannot take (`shape`: the model's own, whose VAE says
    the frame rule; else the family's published one)."""
    from zerotuner.settings.schema import env_name

    problems = []
    if not REGISTRY[family].video:
        videos = ", ".join(f for f, spec in REGISTRY.items() if spec.video)
        problems += [
            f"{env_name(name)} is set but ZT_MODEL is a {family} model, trained on images: unset "
            f"{env_name(name)} (it applies to the video families only: {videos})"
            for name in VIDEO_SETTINGS
            if name in settings.model_fields_set
        ]
    else:
        video = shape.video if shape is not None else None
        step = video.temporal if video is not None else video_scales(None)[0]
        frames = settings.video_frames
        if (frames - 1) % step:
            below = (frames - 1) // step * step + 1
            problems.append(
                f"{env_name('video_frames')}={frames}: {REGISTRY[family].cls} takes "
                f"{step}k+1 frames ({below} or {below + step})"
            )
    flow = REGISTRY[family].flow
    kind = "flow matching (a transformer family)" if flow else "a DDPM UNet (SD 1.x/2.x/XL)"
    foreign = FLOW_SETTINGS if not flow else UNET_SETTINGS
    problems += [
        f"{env_name(name)} is set but ZT_MODEL is a {family} model, trained by {kind}: unset "
        f"{env_name(name)} (it applies to "
        f"{'the transformer families' if name in FLOW_SETTINGS else 'the UNet families'} only)"
        for name in foreign
        if name in settings.model_fields_set
    ]
    problems += expert_problems(settings, family, shape)
    if flow and settings.training_type == "lora" and settings.lora_text_encoder:
        problems.append(
            f"{env_name('lora_text_encoder')}=true: text encoder adapters are for the UNet "
            f"families so far; unset it to train the {family} transformer's adapter alone"
        )
    if problems:
        raise ConfigError(problems[0], problems=problems)


def expert_problems(settings: Any, family: str, shape: ModelShape | None) -> list[str]:
    """ZT_EXPERT against the model: set for a model with one denoiser (a non-Wan family, or a
    Wan model whose configs were read and have no transformer_2), or unset for Wan 2.2 A14B
    (ZT_MODEL_FAMILY=wan skips detection's refusal), or its sigmas (`expert_sigmas`)."""
    from zerotuner.settings.schema import env_name

    expert, name = settings.expert, env_name("expert")
    read = shape is not None and not shape.source.startswith("built-in")
    boundary = shape.boundary_ratio if shape is not None else None
    if expert and family != "wan":
        why = f"it chooses one of Wan 2.2 A14B's two expert transformers; unset {name}"
        return [f"{name}={expert} is set but ZT_MODEL is a {family} model: {why}"]
    if expert and read and boundary is None:
        why = f"not Wan 2.2 A14B's two experts (no transformer_2 in model_index.json); unset {name}"
        return [f"{name}={expert} is set but ZT_MODEL has one transformer, {why}"]
    if not expert and boundary is not None:
        why = f"set {name}=high or {name}=low to train one of them (one expert per run)"
        return [f"ZT_MODEL={settings.model} is Wan 2.2 A14B, two expert transformers: {why}"]
    if expert and read:
        try:
            expert_sigmas(settings, boundary)
        except ConfigError as error:
            return [str(error)]
    return []
