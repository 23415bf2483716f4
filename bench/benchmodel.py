"""The bench model: the demo SDXL pipeline with a ~95M-parameter UNet and a 4x VAE.

The demo's UNet (~1M parameters) is so small that the optimizer step and the gradient
all-reduce are noise; a harness overhead measured on it would say nothing. This UNet is
SDXL-shaped (text_time conditioning, cross-attention on both text encoders' states) and big
enough that Adam and communication matter, while a 3-block VAE (latent scale 4) keeps the
latents at 16x16 for 64 px images, so one 2-rank CPU step takes about a second.
"""

from __future__ import annotations

from pathlib import Path

from zerotuner.demo.parts import exact_vae, latent_scaling_factor
from zerotuner.demo.pipelines import DemoPaths, write_demo

RESOLUTION = 64  # the smallest ZT_RESOLUTION allowed
VAE_BLOCKS = (32, 64, 64)  # latent scale 2 ** 2 = 4: 16x16 latents at 64 px
UNET_BLOCKS = (128, 256, 512)
# --smoke: the same layout at ~4M parameters, so a check of the harness takes seconds per step.
SMOKE_BLOCKS, SMOKE_LAYERS = (32, 64, 128), 1
TEXT_DIM = 32 + 32  # the demo's two text encoders, concatenated
POOLED_DIM = 32
TIME_DIM = 16  # with 8 the bucket (params // 10) is odd and ZeRO-1/2 refuse it (see report)


def unet_config(
    sample_size: int = RESOLUTION // 4, *, small: bool = False, blocks: tuple | None = None
) -> dict:
    blocks = blocks or (SMOKE_BLOCKS if small else UNET_BLOCKS)
    return {
        "sample_size": sample_size,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": blocks,
        "layers_per_block": SMOKE_LAYERS if small else 2,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "attention_head_dim": tuple(c // 32 for c in blocks),
        "cross_attention_dim": TEXT_DIM,
        "use_linear_projection": True,
        "norm_num_groups": 32,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": TIME_DIM,
        "projection_class_embeddings_input_dim": 6 * TIME_DIM + POOLED_DIM,
    }


def write_bench_model(
    dir: Path, *, seed: int = 0, small: bool = False, blocks: tuple | None = None
) -> DemoPaths:
    """DIR/model (the pipeline) and DIR/data (the demo's 64 images); idempotent. `blocks`: the
    UNet's block widths instead of the bench's (load_peak: (256, 512, 1024), ~380M params)."""
    import torch
    from diffusers import UNet2DConditionModel

    paths = write_demo(Path(dir), seed=seed, family="sdxl")
    vae = exact_vae(seed + 10, blocks=VAE_BLOCKS, sample_size=RESOLUTION)
    vae.register_to_config(scaling_factor=latent_scaling_factor(vae, paths.data))
    vae.save_pretrained(paths.model / "vae", safe_serialization=True)
    torch.manual_seed(seed + 11)
    unet = UNet2DConditionModel(**unet_config(small=small, blocks=blocks))
    unet.save_pretrained(paths.model / "unet", safe_serialization=True)
    return paths


def unet_parameters(model: Path) -> int:
    from zerotuner.families import model_shape

    return model_shape("sdxl", Path(model)).denoiser_params
