"""The frozen image encoder of an image-to-video family: the first frame's states, cached beside
the clip's latents (they depend on that frame, not on the caption). Wan 2.1 I2V's CLIP
(wan_i2v.py) and HunyuanVideo 1.5 I2V's SigLIP (hunyuan_video15_i2v.py), each loaded as the
classes its model_index.json names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def load_image_encoder(source: Path, device: torch.device, processor: str) -> Any:
    """(encoder, processor) of the pipeline at `source`: its `image_encoder` and its `processor`
    part (Wan's `image_processor`, HunyuanVideo 1.5's `feature_extractor`), the encoder frozen
    in fp32 on `device`; None where the pipeline has none (Wan 2.2 I2V A14B)."""
    import importlib

    index = json.loads((source / "model_index.json").read_text())
    parts = []
    for name in ("image_encoder", processor):
        library, cls = index.get(name) or (None, None)
        if not library or not cls:
            return None
        parts.append(getattr(importlib.import_module(library), cls))
    encoder_cls, processor_cls = parts
    encoder = encoder_cls.from_pretrained(source, subfolder="image_encoder", dtype=torch.float32)
    image_processor = processor_cls.from_pretrained(source, subfolder=processor)
    return encoder.to(device).eval().requires_grad_(False), image_processor


def first_frames_uint8(clip: torch.Tensor) -> list[Any]:
    """The first frame of each clip (batch, 3, frames, h, w) in [-1, 1] as (h, w, 3) uint8 arrays,
    as an image processor reads a PIL image."""
    frames = ((clip[:, :, 0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return list(frames.permute(0, 2, 3, 1).cpu().numpy())
