"""A tiny Wan image-to-video pipeline (WanImageToVideoPipeline), built offline from the real
diffusers/transformers classes as demo/wan.py's: its UMT5 encoder, T5 tokenizer and scheduler;
a video VAE folding 4 frames into one (as the published one); a WanTransformer3DModel of two
blocks that takes 36 channels (the noisy latents, the first frame's mask and its latents) and
attends to the first frame's CLIP states (`image_dim`, `added_kv_proj_dim`: Wan 2.1 I2V's
shape); and a tiny CLIPVisionModel with its CLIPImageProcessor (32 px). Saved with
`save_pretrained`, it generates a clip from an input image through WanImageToVideoPipeline.
"""

from __future__ import annotations

from pathlib import Path

from zerotuner.demo.wan import _vae, write_wan

IMAGE_SIDE = 32  # the tiny image encoder's input (the published ViT-H/14's is 224)
IMAGE_WIDTH = 32  # its hidden states' width: the transformer's image_dim


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
    from diffusers import WanImageToVideoPipeline

    from zerotuner.demo.flow import LATENT_CHANNELS

    image_encoder, image_processor = _image_encoder(seed + 5)
    return write_wan(
        model_dir, WanImageToVideoPipeline, seed=seed, corpus=corpus,
        transformer_config={"in_channels": LATENT_CHANNELS * 2 + 4, "image_dim": IMAGE_WIDTH,
                            "added_kv_proj_dim": 32},
        vae=_vae(seed, data_dir, temporal=4), image_encoder=image_encoder,
        image_processor=image_processor,
    )  # fmt: skip
