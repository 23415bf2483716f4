"""A tiny Wan pipeline, built offline from the real diffusers/transformers classes: a
WanTransformer3DModel of two blocks, a two-layer UMT5EncoderModel with the T5 tokenizer of the
SD3/Flux demos (flow.py), a small AutoencoderKLWan (4 pixels per latent cell, 16 channels,
random weights: its latents are normalised by their per-channel mean and std on the demo
images, as the published VAE's `latents_mean` / `latents_std` do) and the scheduler the
published Wan2.1 pipelines ship (UniPCMultistepScheduler with flow sigmas, `flow_shift` 3.0).
Saved with `save_pretrained`, it loads and generates (one-frame clips or short videos) through
WanPipeline.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.demo.parts import normalise_video_latents

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5EncoderModel


def _umt5(vocab_size: int, seed: int) -> UMT5EncoderModel:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from zerotuner.demo.flow import T5_WIDTH

    torch.manual_seed(seed)
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size, d_model=T5_WIDTH, d_ff=T5_WIDTH * 2, d_kv=16, num_layers=2,
            num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip


def _vae(seed: int, data_dir: Path | None, temporal: int = 2) -> AutoencoderKLWan:
    """A small video VAE: two spatial halvings, `temporal` frames folded into one (2; image-to-
    video's 4, as the published one: its first-frame mask has a channel per folded frame),
    its latents' per-channel mean and std measured on the demo images (one-frame clips)."""
    import torch
    from diffusers import AutoencoderKLWan

    from zerotuner.demo.flow import LATENT_CHANNELS

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[temporal == 4, True], latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS, scale_factor_spatial=4,
        scale_factor_temporal=temporal,
    )  # fmt: skip
    return normalise_video_latents(vae, data_dir)


def scheduler() -> UniPCMultistepScheduler:
    """Wan2.1-T2V-1.3B-Diffusers' scheduler/scheduler_config.json (its non-default fields)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        num_train_timesteps=1000, solver_order=2, beta_end=0.02,
    )  # fmt: skip


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    from diffusers import WanPipeline

    return write_wan(model_dir, WanPipeline, seed=seed, corpus=corpus, vae=_vae(seed, data_dir))


def write_wan(
    model_dir: Path, pipeline: type, *, seed: int, corpus: list[str],
    transformer_config: Mapping[str, Any] | None = None, **parts: Any,
) -> Path:  # fmt: skip
    """A tiny Wan pipeline of class `pipeline`: the UMT5 encoder, the T5 tokenizer, the
    scheduler, a two-block transformer (`transformer_config`: what it changes of the
    text-to-video one) and `parts` (the VAE; image-to-video's image encoder)."""
    import torch
    from diffusers import WanTransformer3DModel

    from zerotuner.demo.flow import LATENT_CHANNELS, T5_WIDTH, save_pipeline, write_t5_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_t5_tokenizer(work / "t5", corpus)
    text_encoder = _umt5(len(tokenizer), seed + 4)
    torch.manual_seed(seed + 3)
    config = {
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16,
        "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "text_dim": T5_WIDTH,
        "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 64,
        **(transformer_config or {}),
    }  # fmt: skip
    return save_pipeline(
        model_dir, work, pipeline, transformer=WanTransformer3DModel(**config),
        scheduler=scheduler(), text_encoder=text_encoder, tokenizer=tokenizer, **parts,
    )  # fmt: skip
