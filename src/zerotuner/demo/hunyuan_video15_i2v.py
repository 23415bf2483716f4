"""A tiny HunyuanVideo 1.5 image-to-video pipeline: demo/hunyuan_video15.py's parts (the
transformer's `task_type` i2v, as the published i2v configs) with a tiny SiglipVisionModel and
its SiglipImageProcessor (32 px, 16 tokens of the transformer's image width), saved as a
HunyuanVideo15ImageToVideoPipeline, which generates a clip from an input image.
"""

from __future__ import annotations

from pathlib import Path

from zerotuner.demo.hunyuan_video15 import IMAGE_WIDTH, write_hunyuan_video15

IMAGE_SIDE = 32  # the tiny image encoder's input (the published SigLIP's is 384)


def _image_encoder(seed: int) -> tuple[object, object]:
    """A tiny SigLIP vision tower with its processor (resized to 32 px)."""
    import torch
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=IMAGE_WIDTH, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, image_size=IMAGE_SIDE, patch_size=8,
        )
    ).eval()  # fmt: skip
    processor = SiglipImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return encoder, processor


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    image_encoder, feature_extractor = _image_encoder(seed + 6)
    return write_hunyuan_video15(
        model_dir, HunyuanVideo15ImageToVideoPipeline, seed=seed, corpus=corpus,
        data_dir=data_dir, task_type="i2v", image_encoder=image_encoder,
        feature_extractor=feature_extractor,
    )  # fmt: skip
