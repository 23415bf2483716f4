"""Model families: the UNet families (SDXL, SD 1.x, SD 2.x) and the flow-matching transformer
families (SD3 / SD3.5, Flux.1, Chroma, Z-Image, Qwen-Image, FLUX.2 [dev] and [klein], Wan).

What the planner and the normalizer need before any weights exist, torch-free:
- `registry`: each family's `Spec` in REGISTRY (the one list of family names) and `get(name)`,
  its trainer (a `base.ModelFamily` subclass in its own module, imported on first use);
- `detection`: which family a model folder, ZT_MODEL_FAMILY or a hub id names;
- `shapes`: a model's `ModelShape` (counts from safetensors headers or the meta device, VAE
  scale, activations, a video family's clip geometry);
- `family_settings`: settings that do not apply to a family; `wan_variants`: Wan's refused
  variants and A14B's experts.
The loop, checkpoints, export and the planner never name a family. This face re-exports what
the other stages use; docs/architecture.md "Add a family" says where a new one goes.
"""

from __future__ import annotations

from zerotuner.families.detection import (
    HUB_CONFIG_FILES,
    detect_family,
    distilled_note,
    guess_family,
    hub_cache_dir,
    refuse_missing_parts,
    resolve_family,
)
from zerotuner.families.family_settings import check_family_settings
from zerotuner.families.registry import (
    FAMILIES,
    FLOW_FAMILIES,
    REGISTRY,
    Family,
    Spec,
    get,
    known_family,
)
from zerotuner.families.shapes import (
    ModelShape,
    VideoShape,
    bucket_step,
    caption_cache_bytes,
    frozen_params,
    meta_model,
    model_shape,
    vae_latent_channels,
    vae_scale,
    video_shape,
)
from zerotuner.families.stored import unet_config_path
from zerotuner.families.wan_variants import EXPERTS

__all__ = [
    "EXPERTS", "FAMILIES", "FLOW_FAMILIES", "HUB_CONFIG_FILES", "REGISTRY", "Family",
    "ModelShape", "Spec", "VideoShape", "bucket_step", "caption_cache_bytes",
    "check_family_settings", "detect_family", "distilled_note", "frozen_params", "get",
    "guess_family", "hub_cache_dir", "known_family", "meta_model", "model_shape",
    "refuse_missing_parts", "resolve_family", "unet_config_path", "vae_latent_channels",
    "vae_scale", "video_shape",
]  # fmt: skip
