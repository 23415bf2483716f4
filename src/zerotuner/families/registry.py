"""The family registry: each family's torch-free facts (`Spec`), the published models' sizes they
are counted from, and the tables derived from them. The registry's keys are the family names
(ZT_MODEL_FAMILY's choices: `known_family`; the docs and the builder list them from here);
`get(name)` imports the family's trainer module on first use, so planning needs no
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zerotuner.errors import ConfigError


@dataclass(frozen=True)
class Spec:
    """A family's facts that need no torch: where its trainer lives, how a pipeline's files and
    a hub id name it, its published model's config and sizes, and what a cached caption holds.
    A new family is its module (one `base.ModelFamily` subclass) and one entry in REGISTRY, or
    a package's entry point (`installed_families`)."""

    module: str  # zerotuner/families/<module>.py, or a dotted import path (an installed family)
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
    # a transformer's config field counting the encoder layers whose states a cached caption
    # stacks per token (Krea 2's num_text_layers: 12 of Qwen3-VL's); "": one
    text_layers_key: str = ""
    # a cached caption token's values where the transformer's config does not say them (HiDream:
    # T5's and each of Llama's 32 layers' states, 33 x 4096); 0: text_width_key's
    caption_width: int = 0
    # values a cached caption holds beside those tokens' (HunyuanVideo 1.5's ByT5 glyph states,
    # 256 x 1472)
    other_text_values: int = 0
    # A video family (Wan) trains clips of ZT_VIDEO_FRAMES frames: the planner counts frames x
    # tokens (`VideoShape`) and the frame rule (`frames = temporal * k + 1`) is checked.
    video: bool = False
    # The side of the square whose area it plans for (ZT_RESOLUTION's default, the area side
    # buckets are cut at): 1024 px; Wan's 480p, 832 x 480 (399,360 px), fits in 632^2.
    native_resolution: int = 1024
    # Its tiny demo pipeline's writer, "module:function" in zerotuner/demo or a dotted import
    # path (`zerotuner demo`, the tests' models); "": the UNet families' and SD3's and Flux's,
    # in demo/pipelines.py and demo/flow.py
    demo: str = ""
    # The undistilled checkpoint a distilled one's adapters are trained on (a pipeline whose
    # model_index.json says `is_distilled`, or a hub name with a distilled marker: preflight
    # notes it)
    base_model: str = ""
    # what a hub id's name says of a distilled checkpoint (Krea 2 Turbo's; HiDream's Dev, Fast)
    distilled_markers: tuple[str, ...] = ("turbo",)
    # Control images each target trains with (an edit model's inputs: data/controls.py), the
    # most it takes; 0: a text-to-image family, which refuses them
    controls: int = 0
    # the fewest it takes (Qwen-Image-Edit Plus: 1 to 3; FLUX.2: 0, its reference images are
    # optional: a run whose data have none trains text-to-image); None: exactly `controls`.
    # One run's items all have the same count (a batch stacks their controls: data/controls.py)
    min_controls: int | None = None
    # An image-to-video family: its pipeline samples from a first frame (sample_input)
    image_to_video: bool = False
    # Parts a model folder must name in its model_index.json for this family to train on it
    # (HunyuanVideo 1.5 I2V's SigLIP: ZT_MODEL_FAMILY may name it on a text-to-video folder)
    required_parts: tuple[str, ...] = ()
    # Its captions' states depend on the control images (Qwen-Image-Edit's Qwen2.5-VL reads
    # them): cached per item in its latent entry, not per caption (train/feature_cache.py)
    captions_per_item: bool = False
    # the tokens each control image adds to a caption's states at the native resolution
    # (Qwen-Image-Edit: Qwen2.5-VL reads a 1024^2 control in 28 px merged patches, 37 x 37)
    control_text_tokens: int = 0
    # Of text_params, what a low ZT_TEXT_ENCODER_PRECISION keeps at the run's precision (the
    # published encoders' *_KEPT below); None: not known, the planner counts them all so
    text_kept_params: int | None = None

    @property
    def sample_input(self) -> str:
        """What its pipeline samples from besides the prompt (train/validation_inputs.py): ""
        none, "control image" (an edit model's), "first frame" (image-to-video)."""
        return "control image" if self.controls else "first frame" if self.image_to_video else ""

    @property
    def sample_images(self) -> int:
        """The most input images one sample takes (ZT_VALIDATION_IMAGES per prompt): its most
        control images, else one (a first frame)."""
        return self.controls or 1

    def run_sample_input(self, controls: int | None) -> str:
        """What one run's samples take besides the prompt, its targets having `controls`
        control images each (None: not known yet): a family whose control images are optional
        (FLUX.2) samples from its prompts alone where its data have none."""
        return "" if self.optional_controls and controls == 0 else self.sample_input

    @property
    def exported_class(self) -> str:
        """The `_class_name` of the pipeline folders it exports, where not the base folder's: a
        family that samples from an input image writes the pipeline it sampled with (LTX-2 and
        Wan 2.2 TI2V-5B trained as image-to-video on their text-to-video folders load as such);
        "": the base's own (a text-to-image family keeps its folder's variant; FLUX.2's, whose
        reference images are optional, takes them in its own pipeline)."""
        return self.pipeline if self.sample_input and not self.optional_controls else ""

    @property
    def control_counts(self) -> range:
        """The control image counts a target may train with (empty: a text-to-image family;
        from 0: references are optional)."""
        if not self.controls:
            return range(0)
        fewest = self.controls if self.min_controls is None else self.min_controls
        return range(fewest, self.controls + 1)

    @property
    def optional_controls(self) -> bool:
        """It trains with control images or without (FLUX.2: editing or text-to-image, one
        checkpoint): the run's data say which."""
        return bool(self.controls) and self.min_controls == 0

    def planned_controls(self, listed: int | None) -> int:
        """The control images a target's tokens are planned with: an edit family's most (the
        plan is made before the data are decoded); an optional-controls family's as the data's
        file names tell (`listed`: data.scan.listed_references; None, not there yet: 0)."""
        if not self.optional_controls:
            return self.controls
        return min(listed or 0, self.controls)

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
# What a text encoder stored in 8 bits (ZT_TEXT_ENCODER_PRECISION) keeps at the run's precision:
# the layers outside its numbered blocks (weights.base_precision.stored_low), its token (and
# position) embeddings, an untied output head, a vision tower's patch convolution and projector;
# the blocks' biases and norms (under 0.1 %) count as stored.
CLIP_L_KEPT = 38_004_480  # 49408 x 768 tokens + 77 x 768 positions
CLIP_L_SD3_KEPT = CLIP_L_KEPT + 589_824  # and its 768 x 768 text projection
CLIP_G_KEPT = 64_979_200  # 49408 x 1280 + 77 x 1280 + its 1280 x 1280 text projection
OPEN_CLIP_H_KEPT = 50_672_640  # 49408 x 1024 + 77 x 1024
T5_XXL_KEPT = 131_596_288  # 32128 x 4096
UMT5_XXL_KEPT = 1_050_148_864  # 256384 x 4096
QWEN25_VL_7B_KEPT = 1_091_507_712  # 152064 x 3584 twice (untied head), 3 x 1280 x 2 x 14 x 14
QWEN3_4B_KEPT = 388_956_160  # 151936 x 2560, tied
# 131072 x 5120 twice (untied head), the 3 x 1024 x 14 x 14 patch convolution, the projector's
# 4096 x 1024, 1024 x 5120 and 5120 x 5120
MISTRAL_SMALL_3_KEPT = 1_378_430_976
FLUX2_VAE_PARAMS = 84_046_115  # AutoencoderKLFlux2's defaults
# UMT5EncoderModel of google/umt5-xxl's config (Wan's text encoder: d_model 4096, 24 layers,
# vocabulary 256384), its token embedding counted once (`encoder.embed_tokens` is `shared`)
UMT5_XXL_PARAMS = 5_680_910_336
# Qwen3VLModel of Qwen/Qwen3-VL-4B-Instruct's config.json (text: Qwen3-4B's shapes, embeddings
# tied; vision: 24 blocks 1024 wide), what Krea2Pipeline loads as its text encoder (no lm_head)
QWEN3_VL_4B_PARAMS = 4_437_815_808
# CLIPVisionModel of laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config: Wan 2.1 I2V's image encoder
CLIP_VIT_H_PARAMS = 630_766_080
# HiDream-I1's four encoders (HiDream-ai/HiDream-I1-Full's text_encoder*/config.json as diffusers'
# HiDream docs and example load them): CLIP-L and CLIP-G with projections and 248 position
# embeddings (the pipeline encodes up to 218 CLIP tokens; assumed from the published configs'
# max_position_embeddings: 248), T5-XXL's encoder and LlamaForCausalLM of
# meta-llama/Llama-3.1-8B-Instruct's config (lm_head untied: 8.03B). The four, 27 GB in bf16,
# stream from host memory while caching: Llama's largest layer (128256 x 4096) on the device.
CLIP_L_248, CLIP_G_248, LLAMA_31_8B_PARAMS = 123_781_632, 694_878_720, 8_030_261_248
LLAMA_31_8B_LAYER = 525_336_576
# what an 8-bit ZT_TEXT_ENCODER_PRECISION keeps of them: CLIP-L's and CLIP-G's tokens, 248
# positions and projections; Llama's token embedding and its untied lm_head (128256 x 4096 each)
HIDREAM_TEXT_KEPT = (
    (49408 + 248 + 768) * 768 + (49408 + 248 + 1280) * 1280 + T5_XXL_KEPT + 2 * LLAMA_31_8B_LAYER
)
WAN_VAE_PARAMS = 126_892_531  # AutoencoderKLWan's defaults, Wan 2.1's VAE (Qwen-Image's network)
# LTX-2's frozen parts, counted on the meta device: Gemma3ForConditionalGeneration of
# google/gemma-3-12b-it's config (its 12.19B: the card's "12B"; its largest layer the token
# embedding, 262208 x 3840, streamed while caching as FLUX.2 [dev]'s Mistral is),
# LTX2TextConnectors' defaults (Gemma 3 12B's 49 stacked states into 3840), and
# AutoencoderKLLTX2Video as diffusers' scripts/convert_ltx2_to_diffusers.py writes LTX-2.0's,
# AutoencoderKLLTX2Audio's defaults and that script's LTX2Vocoder
GEMMA3_12B_PARAMS, LTX2_CONNECTORS_PARAMS = 12_187_325_040, 1_431_475_200
GEMMA3_12B_LAYER = 1_006_878_720
LTX2_VAE_PARAMS = 1_222_479_601 + 53_248_146 + 55_592_802  # video VAE, audio VAE, vocoder
# HunyuanVideo 1.5's frozen parts, counted on the meta device: Qwen2_5_VLTextModel of
# Qwen/Qwen2.5-VL-7B-Instruct's text config (no vision tower, no lm_head: what
# HunyuanVideo15Pipeline loads), T5EncoderModel of google/byt5-small's config (its glyph encoder,
# 1472 wide) and AutoencoderKLHunyuanVideo15's defaults (the published VAE: 32 channels, 16 x 4);
# Qwen streams from host memory while caching, its largest layer (the token embedding) on the
# device, as FLUX.2 [dev]'s Mistral
QWEN25_VL_7B_TEXT_PARAMS, BYT5_SMALL_ENCODER_PARAMS = 7_070_619_136, 217_657_472
QWEN25_VL_7B_TEXT_LAYER = 152064 * 3584
HUNYUAN_VIDEO15_VAE_PARAMS = 1_260_634_115
QWEN25_VL_7B_TEXT_KEPT = QWEN25_VL_7B_TEXT_LAYER  # what an 8-bit one keeps (it has no lm_head)
BYT5_SMALL_KEPT = 384 * 1472  # and ByT5's
# SiglipVisionModel of google/siglip-so400m-patch14-384's vision config (27 layers, 1152 wide,
# 729 tokens at 384 px, its pooling head included): HunyuanVideo 1.5 I2V's image encoder, FLUX.1
# Redux's, as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py `load_siglip` takes it
SIGLIP_SO400M_PARAMS = 428_225_600
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
# scripts/convert_wan_to_diffusers.py writes for Wan-T2V-1.3B: 1.42B, the card's "1.3B"; UMT5-XXL),
# black-forest-labs/FLUX.1-Kontext-dev (FLUX.1-dev's transformer config, encoders and VAE),
# krea/Krea-2-Raw (Krea2Transformer2DModel's defaults, its diffusers checkpoint's config: 12.82B,
# the card's "12.9B"; Qwen3-VL-4B and Qwen-Image's VAE; krea/Krea-2-Turbo is the same network),
# Lightricks/LTX-2 (the transformer config diffusers' scripts/convert_ltx2_to_diffusers.py writes
# for LTX-2.0, LTX2VideoTransformer3DModel's defaults: 18.88B, the card's "19B"; Gemma 3 12B).
# HiDream-ai/HiDream-I1-Full (the transformer config diffusers' scripts/convert_hidream_to_
# diffusers.py writes: 17.11B, the card's "17B"; -Dev and -Fast are the same network).
# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (HunyuanVideo15Transformer3DModel's
# defaults, the 480p and 720p transformers' shapes: 8.33B, the card's "8.3B"; Qwen2.5-VL-7B's
# text model and ByT5-small's encoder).
ENTRY_POINTS = "zerotuner.families"  # the group an installed family's package names its Spec in


def installed_families(builtin: dict[str, Spec]) -> dict[str, Spec]:
    """Families another installed package adds: each entry point of ENTRY_POINTS is a family
    name and the `package.module:SPEC` naming its Spec (`module` and `demo` as dotted import
    paths), so a family outside this repository needs no edit here."""
    from importlib.metadata import entry_points

    found: dict[str, Spec] = {}
    for point in entry_points(group=ENTRY_POINTS):
        spec = point.load()
        if not isinstance(spec, Spec):
            raise ImportError(f"entry point {point.name} = {point.value}: not a families Spec")
        if point.name in builtin:
            raise ImportError(f"entry point {point.name} = {point.value}: a built-in family")
        found[point.name] = spec
    return found


QWEN_IMAGE = Spec(
    "qwen_image", "QwenImage",
    {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
     "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
    (20_430_401_088, 56_623_104), QWEN25_VL_7B_PARAMS, QWEN_VAE_PARAMS,
    flow=True, pipeline="QwenImagePipeline", transformer="QwenImageTransformer2DModel",
    hub_markers=("qwen-image", "qwen_image", "qwenimage"), guess_order=-1, clip_tokens=0,
    t5_tokens=512, long_encoder="Qwen2.5-VL", layer_keys=("num_layers",),
    demo="qwen_image:write_model",
    text_kept_params=QWEN25_VL_7B_KEPT,
)  # fmt: skip
FLUX = Spec(
    "flow", "Flux",
    {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
     "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
    (11_901_408_320, 56_623_104), CLIP_L + T5_XXL_PARAMS, VAE16_PARAMS,
    flow=True, pipeline="FluxPipeline", transformer="FluxTransformer2DModel",
    hub_markers=("flux",), guess_order=0, clip_tokens=0, t5_tokens=512,
    layer_keys=("num_layers", "num_single_layers"),
    text_kept_params=CLIP_L_KEPT + T5_XXL_KEPT,
)  # fmt: skip

LTX2_SPEC = Spec(
    "ltx2", "LTX2",
    {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
     "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
     "vae_scale_factors": [8, 32, 32], "audio_in_channels": 128, "audio_out_channels": 128,
     "audio_num_attention_heads": 32, "audio_attention_head_dim": 64,
     "audio_cross_attention_dim": 2048, "num_layers": 48, "caption_channels": 3840},
    (18_876_174_592, 100_663_296), GEMMA3_12B_PARAMS + LTX2_CONNECTORS_PARAMS,
    LTX2_VAE_PARAMS,
    flow=True, pipeline="LTX2Pipeline", transformer="LTX2VideoTransformer3DModel",
    hub_markers=("ltx-2", "ltx2"), guess_order=-1, clip_tokens=0, t5_tokens=1024,
    long_encoder="Gemma3", text_stream_params=GEMMA3_12B_LAYER, layer_keys=("num_layers",),
    text_width_key="caption_channels",
    video=True, native_resolution=640,
    demo="ltx2:write_model",
)  # fmt: skip

HUNYUAN_VIDEO15 = Spec(
    "hunyuan_video15", "HunyuanVideo15",
    {"in_channels": 65, "out_channels": 32, "num_attention_heads": 16,
     "attention_head_dim": 128, "num_layers": 54, "num_refiner_layers": 2, "mlp_ratio": 4.0,
     "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 3584, "text_embed_2_dim": 1472,
     "image_embed_dim": 1152, "rope_axes_dim": [16, 56, 56], "target_size": 640},
    (8_326_608_160, 25_165_824), QWEN25_VL_7B_TEXT_PARAMS + BYT5_SMALL_ENCODER_PARAMS,
    HUNYUAN_VIDEO15_VAE_PARAMS,
    flow=True, pipeline="HunyuanVideo15Pipeline",
    transformer="HunyuanVideo15Transformer3DModel",
    hub_markers=("hunyuanvideo-1.5", "hunyuanvideo1.5", "hunyuan-video-1.5",
                 "hunyuanvideo-15", "hunyuanvideo15"),
    # tried before Wan I2V's `_i2v` (after its image-to-video family, whose ids contain these)
    guess_order=-3, clip_tokens=0, t5_tokens=1000, long_encoder="Qwen2.5-VL",
    text_stream_params=QWEN25_VL_7B_TEXT_LAYER, layer_keys=("num_layers",),
    text_width_key="text_embed_dim",
    other_text_values=256 * 1472, video=True, native_resolution=640,
    demo="hunyuan_video15:write_model",
    text_kept_params=QWEN25_VL_7B_TEXT_KEPT + BYT5_SMALL_KEPT,
)  # fmt: skip

BUILTIN: dict[str, Spec] = {
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
        text_kept_params=CLIP_L_KEPT + CLIP_G_KEPT,
    ),
    "sd1": Spec(
        "unet", "StableDiffusion",
        {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8},
        (859_520_964, 29_491_200), CLIP_L, VAE_PARAMS,
        hub_markers=("stable-diffusion-v1", "sd1", "v1"), guess_order=4,
        text_kept_params=CLIP_L_KEPT,
    ),
    "sd2": Spec(
        "unet", "StableDiffusion",
        {"sample_size": 96, "cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20],
         "use_linear_projection": True},
        (865_910_724, 29_491_200), 340_387_840, VAE_PARAMS,  # OpenCLIP ViT-H
        hub_markers=("stable-diffusion-2", "sd2", "-2", "v2"), guess_order=3,
        text_kept_params=OPEN_CLIP_H_KEPT,
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
        text_kept_params=CLIP_L_SD3_KEPT + CLIP_G_KEPT + T5_XXL_KEPT,
    ),
    "flux": FLUX,
    # FLUX.1 Kontext is FLUX.1's network: only its trainer, pipeline and one control image differ
    "fluxkontext": replace(
        FLUX, module="flux_kontext", cls="FluxKontext", pipeline="FluxKontextPipeline",
        hub_markers=("kontext",), guess_order=-4, demo="flux_kontext:write_model", controls=1,
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
        demo="chroma:write_model",
        text_kept_params=T5_XXL_KEPT,
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
        demo="z_image:write_model",
        text_kept_params=QWEN3_4B_KEPT,
    ),
    "qwenimage": QWEN_IMAGE,
    # Qwen-Image-Edit is Qwen-Image's network (Qwen/Qwen-Image-Edit's transformer/config.json is
    # Qwen-Image's, its encoder Qwen2.5-VL-7B with the vision tower that reads the control
    # image): its trainer, pipeline, one control, and captions cached per item differ
    "qwenimageedit": replace(
        QWEN_IMAGE, module="qwen_image_edit", cls="QwenImageEdit",
        pipeline="QwenImageEditPipeline", hub_markers=("qwen-image-edit", "qwen_image_edit"),
        guess_order=-5, demo="qwen_image_edit:write_model", controls=1, captions_per_item=True,
        control_text_tokens=37 * 37,
    ),
    # Qwen-Image-Edit Plus (Qwen/Qwen-Image-Edit-2509 and -2511: Qwen-Image's transformer config,
    # the same encoder and VAE) takes 1 to 3 references, each read by Qwen2.5-VL at 384^2 in
    # area (the pipeline's CONDITION_IMAGE_SIZE: 14 x 14 merged 28 px patches) after its
    # "Picture N: " words (a few tokens: counted as 5); tried before qwenimageedit, whose
    # markers its names contain
    "qwenimageeditplus": replace(
        QWEN_IMAGE, module="qwen_image_edit_plus", cls="QwenImageEditPlus",
        pipeline="QwenImageEditPlusPipeline",
        hub_markers=("qwen-image-edit-2509", "qwen-image-edit-2511", "qwen-image-edit-plus",
                     "qwen_image_edit_plus"),
        guess_order=-6, demo="qwen_image_edit_plus:write_model", controls=3, min_controls=1,
        captions_per_item=True, control_text_tokens=14 * 14 + 5,
    ),
    # FLUX.2 edits with reference images in the same checkpoint: 0 (text-to-image) to the most
    # BFL's docs give per model (docs.bfl.ai, guides/prompting_editing_overview, "Reference
    # Images per Model": [dev] "Recommended max 6", [klein] 4B and 9B "Up to 4")
    "flux2": Spec(
        "flux2", "Flux2",
        {"patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48,
         "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360},
        (32_223_281_152, 339_738_624), MISTRAL_SMALL_3_PARAMS, FLUX2_VAE_PARAMS,
        flow=True, pipeline="Flux2Pipeline", transformer="Flux2Transformer2DModel",
        hub_markers=("flux.2", "flux2", "flux-2"), guess_order=-2, clip_tokens=0,
        t5_tokens=512, long_encoder="Mistral", text_stream_params=MISTRAL_SMALL_3_LAYER,
        layer_keys=("num_layers", "num_single_layers"),
        demo="flux2:write_model", controls=6, min_controls=0,
        text_kept_params=MISTRAL_SMALL_3_KEPT,
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
        demo="flux2:write_klein_model", controls=4, min_controls=0,
        text_kept_params=QWEN3_4B_KEPT,
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
        demo="wan:write_model",
        text_kept_params=UMT5_XXL_KEPT,
    ),
    "krea2": Spec(
        "krea2", "Krea2",
        {"in_channels": 64, "num_layers": 28, "attention_head_dim": 128,
         "num_attention_heads": 48, "num_key_value_heads": 12, "intermediate_size": 16384,
         "text_hidden_dim": 2560, "num_text_layers": 12, "axes_dims_rope": [32, 48, 48]},
        (12_820_073_036, 226_492_416), QWEN3_VL_4B_PARAMS, QWEN_VAE_PARAMS,
        flow=True, pipeline="Krea2Pipeline", transformer="Krea2Transformer2DModel",
        hub_markers=("krea-2", "krea2", "krea_2"), guess_order=-1, clip_tokens=0,
        t5_tokens=512, long_encoder="Qwen3-VL", layer_keys=("num_layers",),
        text_width_key="text_hidden_dim", text_layers_key="num_text_layers",
        demo="krea2:write_model", base_model="krea/Krea-2-Raw",
    ),
    "ltx2": LTX2_SPEC,
    # LTX-2 image-to-video (families/ltx2_i2v.py): the same network and checkpoint, sampled by
    # LTX2ImageToVideoPipeline; a hub id says ltx2 (one repository for both), ZT_MODEL_FAMILY
    # chooses this
    "ltx2i2v": replace(
        LTX2_SPEC, module="ltx2_i2v", cls="LTX2I2V", pipeline="LTX2ImageToVideoPipeline",
        hub_markers=(), demo="ltx2_i2v:write_model", image_to_video=True,
    ),
    # Wan image-to-video (families/wan_i2v.py): Wan2.1-I2V-14B-480P's transformer (its
    # transformer/config.json: 16.39B, 36 channels in, CLIP ViT-H/14's 1280-wide states through
    # 5120-wide added key/value projections) and UMT5-XXL with that image encoder (631M)
    "wani2v": Spec(
        "wan_i2v", "WanI2V",
        {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
         "in_channels": 36, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
         "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": True,
         "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": 1280,
         "added_kv_proj_dim": 5120},
        (16_394_878_784, 157_286_400), UMT5_XXL_PARAMS + CLIP_VIT_H_PARAMS, WAN_VAE_PARAMS,
        flow=True, pipeline="WanImageToVideoPipeline", transformer="WanTransformer3DModel",
        hub_markers=("-i2v", "_i2v"), guess_order=-2, clip_tokens=0, t5_tokens=512,
        long_encoder="UMT5", layer_keys=("num_layers",), text_width_key="text_dim",
        video=True, native_resolution=632,
        demo="wan_i2v:write_model", image_to_video=True,
        text_kept_params=UMT5_XXL_KEPT + CLIP_VIT_H_PARAMS,  # the image encoder is never stored low
    ),
    "hidream": Spec(
        "hidream", "HiDream",
        {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16,
         "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
         "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4,
         "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32],
         "max_resolution": [128, 128], "llama_layers": [*range(32), *[31] * 16]},
        (17_105_733_184, 78_643_200),
        CLIP_L_248 + CLIP_G_248 + T5_XXL_PARAMS + LLAMA_31_8B_PARAMS, VAE16_PARAMS,
        flow=True, pipeline="HiDreamImagePipeline", transformer="HiDreamImageTransformer2DModel",
        hub_markers=("hidream",), guess_order=-1, clip_tokens=0, t5_tokens=128,
        long_encoder="Llama", text_stream_params=LLAMA_31_8B_LAYER,
        layer_keys=("num_layers", "num_single_layers"),
        caption_width=(1 + 32) * 4096, demo="hidream:write_model",
        base_model="HiDream-ai/HiDream-I1-Full", distilled_markers=("i1-dev", "i1-fast"),
        text_kept_params=HIDREAM_TEXT_KEPT,
    ),
    "hunyuanvideo15": HUNYUAN_VIDEO15,
    # HunyuanVideo 1.5 image-to-video (families/hunyuan_video15_i2v.py): the same transformer class
    # and size (480p_i2v's config is text-to-video's with `task_type` i2v: its 65 input channels
    # already hold the condition latents and mask), SigLIP's 729 states of the first frame; tried
    # before hunyuanvideo15, whose markers its hub ids contain
    "hunyuanvideo15i2v": replace(
        HUNYUAN_VIDEO15, module="hunyuan_video15_i2v", cls="HunyuanVideo15I2V",
        builtin_config={**HUNYUAN_VIDEO15.builtin_config, "task_type": "i2v"},
        text_params=QWEN25_VL_7B_TEXT_PARAMS + BYT5_SMALL_ENCODER_PARAMS + SIGLIP_SO400M_PARAMS,
        pipeline="HunyuanVideo15ImageToVideoPipeline",
        # hunyuanvideo-community's HunyuanVideo-1.5-Diffusers-480p_i2v, -720p_i2v (and their
        # distilled ones), also named without "Diffusers"
        hub_markers=tuple(f"hunyuanvideo-1.5-{d}{size}p_i2v" for d in ("diffusers-", "")
                          for size in (480, 720)),
        guess_order=-4, demo="hunyuan_video15_i2v:write_model", image_to_video=True,
        required_parts=("image_encoder", "feature_extractor"),
        # the image encoder is never stored low
        text_kept_params=QWEN25_VL_7B_TEXT_KEPT + BYT5_SMALL_KEPT + SIGLIP_SO400M_PARAMS,
    ),
}  # fmt: skip
REGISTRY = BUILTIN | installed_families(BUILTIN)
Family = str  # a key of REGISTRY
FAMILIES = tuple(REGISTRY)
FLOW_FAMILIES = tuple(f for f, spec in REGISTRY.items() if spec.flow)
# A class's first family (built-ins first: an installed family sharing a class is named by
# ZT_MODEL_FAMILY or its hub markers); FLUX.2's two transformers: detection.transformer_family
PIPELINES: dict[str, str] = {}
TRANSFORMERS: dict[str, str] = {}
for _family, _spec in REGISTRY.items():
    if _spec.pipeline:
        PIPELINES.setdefault(_spec.pipeline, _family)
    if _spec.transformer:
        TRANSFORMERS.setdefault(_spec.transformer, _family)


def get(name: str) -> Any:
    """The family's `base.ModelFamily` (its module imported on first use: planning needs no
    torch)."""
    import importlib

    spec = REGISTRY[known_family(name)]
    module = importlib.import_module(import_path(spec.module, "zerotuner.families"))
    return getattr(module, spec.cls)(name)


def import_path(module: str, package: str) -> str:
    """A Spec's module name as imported: a built-in family's is in `package`, an installed
    family's is a dotted path of its own."""
    return module if "." in module else f"{package}.{module}"


def known_family(setting: str, *, auto: bool = False) -> Family:
    """ZT_MODEL_FAMILY's value, refused in one line unless it is a family (or, with `auto`,
    `auto`: read from the model)."""
    if setting in REGISTRY or (auto and setting == "auto"):
        return setting
    choices = ("auto", *FAMILIES) if auto else FAMILIES
    raise ConfigError(f"ZT_MODEL_FAMILY={setting}: expected one of {', '.join(choices)}")
