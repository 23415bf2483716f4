"""One image or clip decoded for the VAE: resized to cover its bucket, center-cropped, optionally
mirrored, with its loss mask and its control images cut the same way and SDXL's size/crop
micro-conditioning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from zerotuner.data import clips
from zerotuner.data.buckets import Bucket
from zerotuner.data.dataset import Item, Size


@dataclass(frozen=True)
class Example:
    """One image ready for the VAE, with SDXL's size/crop micro-conditioning."""

    pixels: np.ndarray  # float32, CHW, RGB in [-1, 1]
    caption: str
    original_size: Size  # (h, w) of the source image after EXIF orientation
    crop_top_left: Size  # (top, left) of the crop in the resized image
    target_size: Size  # (h, w) of the bucket
    mask: np.ndarray | None = None  # float32 (1, H, W) in [0, 1], cropped as the pixels
    # an edit model's inputs: float32 (controls, C, H, W) in [-1, 1], cropped as the pixels
    controls: np.ndarray | None = None


def load_example(item: Item, bucket_size: Bucket, *, flip: bool = False) -> Example:
    """RGB pixels resized to cover the bucket, center-cropped, optionally mirrored: (C, H, W),
    or a clip bucket's frames each so: (C, F, H, W). A one-frame clip is in an image's bucket
    and is shaped as an image, so the two batch together."""
    bw, bh = bucket_size[:2]
    w, h = item.size
    scale = max(bw / w, bh / h)
    nw, nh = max(bw, round(w * scale)), max(bh, round(h * scale))
    left, top = (nw - bw) // 2, (nh - bh) // 2

    def fit(
        picture: Image.Image, resample: Image.Resampling = Image.Resampling.LANCZOS
    ) -> Image.Image:
        """The part of `picture` (any size: stretched over the item) that covers the bucket,
        resized straight to the bucket: no picture at the covering size is ever made."""
        pw, ph = picture.size
        box = (left * pw / nw, top * ph / nh, (left + bw) * pw / nw, (top + bh) * ph / nh)
        gap = 3.0 if resample == Image.Resampling.LANCZOS else None
        picture = picture.resize((bw, bh), resample, box=box, reducing_gap=gap)
        return picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else picture

    if item.clip:  # each frame fitted as it is decoded
        fitted = clips.load_clip(
            item.path, fps=item.fps, frames=item.frames, fit=fit, start=item.start
        )
    else:
        with Image.open(item.path) as raw:
            fitted = [fit(_to_rgb(ImageOps.exif_transpose(raw)))]
    arrays = [np.asarray(frame, dtype=np.float32) for frame in fitted]
    # (C, H, W); a clip bucket's (F, H, W, C) -> (C, F, H, W)
    clip = len(bucket_size) == 3
    pixels = np.stack(arrays).transpose(3, 0, 1, 2) if clip else arrays[0].transpose(2, 0, 1)
    pixels = pixels / 127.5 - 1.0
    mask = None
    if item.mask is not None:
        with Image.open(item.mask) as raw:
            grey = ImageOps.exif_transpose(raw).convert("L")
        mask = np.asarray(fit(grey, Image.Resampling.BOX), dtype=np.float32)[None] / 255.0
    controls = None
    if item.controls:  # each stretched over the image (the scan checked their aspect ratios),
        # cut by its box and resized to the bucket: diffusers' Kontext example fits its
        # condition image to the target's size, crop and flip
        fitted_controls = []
        for path in item.controls:
            with Image.open(path) as raw:
                control = fit(_to_rgb(ImageOps.exif_transpose(raw)))
            fitted_controls.append(np.asarray(control, dtype=np.float32).transpose(2, 0, 1))
        controls = np.ascontiguousarray(np.stack(fitted_controls) / 127.5 - 1.0)
    return Example(
        pixels=np.ascontiguousarray(pixels),
        caption=item.caption,
        original_size=(h, w),
        crop_top_left=(top, nw - left - bw if flip else left),  # in the mirrored image
        target_size=(bh, bw),
        mask=mask,
        controls=controls,
    )


def _to_rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels become white (not black); 16-bit images are scaled, not clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        array = np.asarray(image, dtype=np.float32) / 257.0
        image = Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
