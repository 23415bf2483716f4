"""Model families (SDXL, SD 1.x, SD 2.x): built-in UNet configs and parameter shapes.

The planner and the normalizer need parameter counts before any weights exist: the UNet is
built on the meta device (`accelerate.init_empty_weights`) from a local config or from the
built-in config of its family, so planning works on a laptop with nothing downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zerotuner.errors import ConfigError

Family = Literal["sdxl", "sd1", "sd2"]
FAMILIES: tuple[Family, ...] = ("sdxl", "sd1", "sd2")

# The published UNet configs (stabilityai/stable-diffusion-xl-base-1.0,
# runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1), fields that differ from
# diffusers' UNet2DConditionModel defaults only.
BUILTIN_UNET_CONFIGS: dict[Family, dict[str, Any]] = {
    "sdxl": {
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
    "sd1": {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8},
    "sd2": {
        "sample_size": 96,
        "cross_attention_dim": 1024,
        "attention_head_dim": [5, 10, 20, 20],
        "use_linear_projection": True,
    },
}

# Frozen parts (text encoders + VAE) of the published checkpoints, in parameters. They are only
# on the device while latents and embeddings are cached, so the planner counts them separately.
BUILTIN_TEXT_PARAMS: dict[Family, int] = {
    "sdxl": 123_060_480 + 694_659_840,  # CLIP ViT-L + OpenCLIP ViT-bigG (with projection)
    "sd1": 123_060_480,
    "sd2": 340_387_840,  # OpenCLIP ViT-H
}
VAE_PARAMS = 83_653_863
BUILTIN_FROZEN_PARAMS: dict[Family, int] = {
    f: n + VAE_PARAMS for f, n in BUILTIN_TEXT_PARAMS.items()
}
VAE_SCALE = 8  # pixels per latent cell in every family's VAE
# (unet_params, largest_param) of the built-in configs, counted once on the meta device
# (tests/test_plan.py recounts them): building SDXL on the meta device costs seconds.
BUILTIN_UNET_COUNTS: dict[Family, tuple[int, int]] = {
    "sdxl": (2_567_463_684, 29_491_200),
    "sd1": (859_520_964, 29_491_200),
    "sd2": (865_910_724, 29_491_200),
}


@dataclass(frozen=True)
class ModelShape:
    """What memory planning and bucket sizing need to know about the trained UNet."""

    family: Family
    unet_params: int
    largest_param: int  # elements of the biggest tensor (offload buffer_size must hold it)
    frozen_params: int
    native_resolution: int
    source: str  # "built-in sdxl config" or the config file it was counted from
    base_channels: int = 320  # block_out_channels[0]: activation memory scales with it
    vae_channels: int = 128  # the VAE's block_out_channels[0]: so does encoding's memory


# A hub model's files the planner reads (a few KB): the pipeline index and each part's config.
HUB_CONFIG_FILES = ("model_index.json", "*/config.json")


def hub_cache_dir(cache_dir: Path) -> Path:
    """Where hub downloads go: HF_HOME's hub folder, else ZT_CACHE_DIR/huggingface/hub."""
    return Path(os.environ.get("HF_HOME") or cache_dir / "huggingface") / "hub"


def detect_family(model_dir: Path) -> Family:
    """SDXL has a second text encoder and `text_time` conditioning; SD2 attends with 1024 dims."""
    index = model_dir / "model_index.json"
    if index.is_file():
        components = json.loads(index.read_text())
        pipeline = str(components.get("_class_name", ""))
        if "transformer" in components or "unet" not in components and pipeline:
            raise ConfigError(
                f"ZT_MODEL={model_dir}: a {pipeline or 'transformer'} pipeline; zerotuner "
                f"trains the UNet families {', '.join(FAMILIES)} (SD3 and Flux.1 transformers "
                "are not trainable yet)"
            )
        if "text_encoder_2" in components or "XL" in pipeline:
            return "sdxl"
    config = unet_config_path(model_dir)
    if config is None:
        raise ConfigError(
            f"ZT_MODEL={model_dir}: no model_index.json or unet/config.json; "
            "set ZT_MODEL_FAMILY to sdxl, sd1 or sd2"
        )
    unet = json.loads(config.read_text())
    if unet.get("addition_embed_type") == "text_time":
        return "sdxl"
    return "sd2" if unet.get("cross_attention_dim") == 1024 else "sd1"


def unet_config_path(model_dir: Path) -> Path | None:
    for candidate in (model_dir / "unet" / "config.json", model_dir / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def resolve_family(model: str, family_setting: str = "auto") -> Family:
    """ZT_MODEL_FAMILY, else read from a local folder, else guessed from a hub id's name."""
    if family_setting != "auto":
        if family_setting not in FAMILIES:
            raise ConfigError(f"ZT_MODEL_FAMILY={family_setting}: expected auto, sdxl, sd1 or sd2")
        return family_setting  # type: ignore[return-value]
    path = Path(model)
    if path.is_dir():
        return detect_family(path)
    name = model.lower()
    if "xl" in name:
        return "sdxl"
    if "stable-diffusion-2" in name or "sd2" in name:
        return "sd2"
    if "v1-" in name or "stable-diffusion-v1" in name or "sd1" in name:
        return "sd1"
    raise ConfigError(
        f"ZT_MODEL={model}: cannot tell the model family from the name; set ZT_MODEL_FAMILY "
        "to sdxl, sd1 or sd2"
    )


def frozen_params(
    model_dir: Path, parts: tuple[str, ...] = ("text_encoder", "text_encoder_2", "vae")
) -> int:
    """Parameters of the text encoders and VAE (or `parts`) of a local pipeline, counted on
    the meta device."""
    from accelerate import init_empty_weights

    total = 0
    for sub in parts:
        folder = model_dir / sub
        if not (folder / "config.json").is_file():
            continue
        with init_empty_weights():
            if sub == "vae":
                from diffusers import AutoencoderKL

                module = AutoencoderKL.from_config(AutoencoderKL.load_config(str(folder)))
            else:
                import transformers

                config = transformers.AutoConfig.from_pretrained(str(folder))
                arch = (config.architectures or ["CLIPTextModel"])[0]
                module = getattr(transformers, arch)(config)
        total += sum(p.numel() for p in module.parameters())
    return total


def model_shape(
    family: Family, model_dir: Path | None = None, *, recount: bool = False
) -> ModelShape:
    """Count the UNet's parameters on the meta device: no memory, no download.

    A built-in family uses its stored counts unless `recount`.
    """
    config_path = unet_config_path(model_dir) if model_dir else None
    if config_path is None and not recount:
        params, largest = BUILTIN_UNET_COUNTS[family]
        native = int(BUILTIN_UNET_CONFIGS[family]["sample_size"]) * VAE_SCALE
        return ModelShape(
            family, params, largest, BUILTIN_FROZEN_PARAMS[family], native,
            f"built-in {family} config",
        )  # fmt: skip

    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    if config_path is not None:
        config = UNet2DConditionModel.load_config(str(config_path.parent))
        source = str(config_path)
    else:
        config = BUILTIN_UNET_CONFIGS[family]
        source = f"built-in {family} config"
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(config)
    sizes = [p.numel() for p in unet.parameters()]
    return ModelShape(
        family=family,
        unet_params=sum(sizes),
        largest_param=max(sizes),
        frozen_params=BUILTIN_FROZEN_PARAMS[family]
        if config_path is None or model_dir is None
        else frozen_params(model_dir),
        native_resolution=int(unet.config.sample_size) * vae_scale(model_dir),
        source=source,
        base_channels=int(unet.config.block_out_channels[0]),
        vae_channels=_vae_channels(model_dir) if model_dir else 128,
    )


def vae_scale(model_dir: Path | None) -> int:
    """Pixels per latent cell: 8 for the published VAEs, 2 for the tiny demo VAE."""
    config = model_dir / "vae" / "config.json" if model_dir else None
    if config is not None and config.is_file():
        return 2 ** (len(json.loads(config.read_text())["block_out_channels"]) - 1)
    return VAE_SCALE


def _vae_channels(model_dir: Path) -> int:
    config = model_dir / "vae" / "config.json"
    if not config.is_file():
        return 128
    return int(json.loads(config.read_text()).get("block_out_channels", [128])[0])
