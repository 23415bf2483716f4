"""Models the GPU suite trains, all built offline from the demo pipeline (zerotuner.demo.pipelines).

- tiny: the demo itself (the session's `demo_dir` fixture), for resume, SIGTERM and export;
- medium: bench's 95M-parameter SDXL-shaped UNet (bench/benchmodel.py), for ZeRO 0-3, the
  offloads and the planner table (big enough that parameters and optimizer states, not fixed
  buffers, dominate the device memory);
- timing: an SDXL-shaped UNet of about 600M parameters (SDXL's channels, layers per block and
  attention layout with one transformer layer per block instead of 1/2/10) behind an 8x VAE, so
  512-1024 px images give SDXL's 64-128 px latents. It keeps the demo's text encoders, so
  `zerotuner train` and the bare loop train the very same files.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench/ is a top-level package beside src/, not installed

TIMING_VAE_BLOCKS = (32, 64, 64, 64)  # latent scale 2 ** 3 = 8, as SDXL's VAE
TIMING_SMALL_BLOCKS = (32, 64, 128)  # CPU unit tests: the same layout, a few M parameters
DEMO_TEXT_DIM = 32 + 32  # the demo's two text encoders' hidden sizes, concatenated
DEMO_POOLED_DIM = 32  # the demo's second text encoder's projection
TIME_DIM = 256  # SDXL's addition_time_embed_dim


def timing_unet_config(*, small: bool = False, sample_size: int = 128) -> dict[str, Any]:
    blocks = TIMING_SMALL_BLOCKS if small else (320, 640, 1280)
    return {
        "sample_size": sample_size,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": blocks,
        "layers_per_block": 2,
        "transformer_layers_per_block": 1,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "attention_head_dim": tuple(c // 64 for c in blocks),  # SDXL: 64 channels per head
        "cross_attention_dim": DEMO_TEXT_DIM,
        "use_linear_projection": True,
        "norm_num_groups": 32,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": TIME_DIM,
        "projection_class_embeddings_input_dim": 6 * TIME_DIM + DEMO_POOLED_DIM,
    }


def parameters_on_meta(config: dict[str, Any]) -> int:
    """Parameters of a UNet2DConditionModel with `config`, built on the meta device (no memory)."""
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    return sum(p.numel() for p in unet.parameters())


def write_timing_model(folder: Path, *, small: bool = False, seed: int = 0) -> Path:
    """folder/model (the demo pipeline with the timing UNet and an 8x VAE) and folder/data;
    returns folder. Idempotent: an existing model is kept."""
    import torch
    from diffusers import UNet2DConditionModel

    from zerotuner.demo.parts import exact_vae, latent_scaling_factor
    from zerotuner.demo.pipelines import write_demo

    folder = Path(folder)
    if (folder / "model" / "unet" / "config.json").is_file():
        return folder
    paths = write_demo(folder, seed=seed, family="sdxl")
    vae = exact_vae(seed + 10, blocks=TIMING_VAE_BLOCKS, sample_size=1024)
    vae.register_to_config(scaling_factor=latent_scaling_factor(vae, paths.data))
    vae.save_pretrained(paths.model / "vae", safe_serialization=True)
    torch.manual_seed(seed + 11)
    unet = UNet2DConditionModel(**timing_unet_config(small=small))
    unet.save_pretrained(paths.model / "unet", safe_serialization=True)
    return folder


def write_medium_model(folder: Path) -> Path:
    """bench's 95M-parameter SDXL-shaped pipeline (bench/benchmodel.py); returns folder."""
    from bench.benchmodel import write_bench_model

    folder = Path(folder)
    if not (folder / "model" / "unet" / "config.json").is_file():
        write_bench_model(folder)
    return folder


def latent_side(model: Path, resolution: int) -> int:
    """The latent side zerotuner's cache (and bench.bare) use for `resolution` px images."""
    import json

    vae = json.loads((Path(model) / "vae" / "config.json").read_text())
    return resolution // 2 ** (len(vae["block_out_channels"]) - 1)
