"""A tiny Wan image-to-video pipeline (WanImageToVideoPipeline), built offline from the real
diffusers/transformers classes as demo/wan.py's: its UMT5 encoder, T5 tokenizer and scheduler;
a video VAE folding 4 frames into one (as the published one); a WanTransformer3DModel of two
blocks that takes 36 channels (the noisy latents, the first frame's mask and its latents) and
attends to the first frame's CLIP states (`image_dim`, `added_kv_proj_dim`: Wan 2.1 I2V's
shape); and a tiny CLIPVisionModel with its CLIPImageProcessor (32 px). Saved with
`save_pretrained`, it generates a clip from an input image through WanImageToVideoPipeline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from zerotuner.demo.parts import normalise_video_latents
from zerotuner.demo.wan import _umt5, scheduler

IMAGE_SIDE = 32  # the tiny image encoder's input (the published ViT-H/14's is 224)
IMAGE_WIDTH = 32  # its hidden states' width: the transformer's image_dim


def _vae(seed: int, data_dir: Path | None) -> object:
    """demo/wan.py's small video VAE folding 4 frames into one as the published one does (two
    temporal halvings): the pipeline's first-frame mask has one channel per folded frame, 4 as
    the published transformer's 36 inputs take."""
    import torch
    from diffusers import AutoencoderKLWan

    from zerotuner.demo.flow import LATENT_CHANNELS

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[True, True], latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS, scale_factor_spatial=4, scale_factor_temporal=4,
    )  # fmt: skip
    return normalise_video_latents(vae, data_dir)


def _image_encoder(seed: int) -> tuple[object, object]:
    """A tiny CLIP vision tower with its processor (resized and centre-cropped to 32 px)."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=IMAGE_WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, image_size=IMAGE_SIDE, patch_size=8,
        )
    )  # fmt: skip
    processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    )
    return encoder, processor


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from zerotuner.demo.flow import LATENT_CHANNELS, T5_WIDTH, save_pipeline, write_t5_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_t5_tokenizer(work / "t5", corpus)
    text_encoder = _umt5(len(tokenizer), seed + 4)
    torch.manual_seed(seed + 3)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
        in_channels=LATENT_CHANNELS * 2 + 4, out_channels=LATENT_CHANNELS, text_dim=T5_WIDTH,
        freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=IMAGE_WIDTH,
        added_kv_proj_dim=32,
    )  # fmt: skip
    image_encoder, image_processor = _image_encoder(seed + 5)
    return save_pipeline(
        model_dir, work, WanImageToVideoPipeline, transformer=transformer,
        scheduler=scheduler(), vae=_vae(seed, data_dir), text_encoder=text_encoder,
        tokenizer=tokenizer, image_encoder=image_encoder, image_processor=image_processor,
    )  # fmt: skip
