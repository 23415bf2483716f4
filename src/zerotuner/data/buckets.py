"""Aspect-ratio buckets: the sizes a resolution allows and the one each image or clip trains at.

Every bucket holds about resolution**2 pixels, its sides multiples of the bucket step (the
step itself is `families.bucket_step`'s rule); an image goes to the bucket closest to its
aspect ratio, a clip also by its frames. Several datasets each bucket at their own resolution
(`dataset_buckets`), each item listed once per repeat.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zerotuner.data.dataset import Dataset, Item, Size
from zerotuner.errors import ConfigError

# A bucket: (width, height), and for clips of more than one frame (width, height, frames).
Bucket = tuple[int, ...]


def bucket_sizes(resolution: int, *, multiple: int = 64, max_aspect: float = 4.0) -> list[Size]:
    """(w, h) pairs, sides multiples of `multiple`, area at most resolution**2 and close to it.

    For each short side the longest fitting long side is taken (both orientations), so every
    bucket holds about the trained number of pixels; ratios beyond max_aspect are left out.
    """
    if multiple <= 0 or resolution < multiple:
        raise ConfigError(
            f"ZT_RESOLUTION={resolution}: must be at least the bucket step {multiple} pixels"
        )
    area = resolution * resolution
    square = resolution // multiple * multiple
    sizes = {(square, square)}
    for short in range(multiple, resolution + 1, multiple):
        long = area // short // multiple * multiple
        if long / short <= max_aspect:
            sizes.update({(short, long), (long, short)})
    return sorted(sizes)


def nearest_bucket(size: Size, buckets: Sequence[Size]) -> Size:
    """The bucket whose aspect ratio is closest in log space (ties: the larger area)."""
    ratio = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - ratio), -b[0] * b[1], b))


def native_bucket(
    size: Size, bucket: Size, *, resolution: int, multiple: int = 64, max_aspect: float = 4.0
) -> Size:
    """The bucket of an image with ZT_UPSCALE=false: `bucket` (its nearest) when the image
    covers it, else the image's own size rounded down to `multiple` per side -- the long side
    cut to max_aspect times the short one, the area kept within resolution**2 -- so it is
    shrunk a little and cropped, never enlarged. A side shorter than one step becomes the step
    (the one enlargement left; `notes.upscale_warning` names those)."""
    (w, h), (bw, bh) = size, bucket
    if w >= bw and h >= bh:
        return bucket
    nw, nh = (max(multiple, side // multiple * multiple) for side in size)
    limit = max(multiple, int(min(nw, nh) * max_aspect) // multiple * multiple)
    nw, nh = min(nw, limit), min(nh, limit)
    while nw * nh > resolution * resolution and max(nw, nh) > multiple:
        nw, nh = (nw - multiple, nh) if nw >= nh else (nw, nh - multiple)
    return nw, nh


def assign_buckets(
    items: Sequence[Item | None],
    resolution: int,
    *,
    multiple: int = 64,
    max_aspect: float = 4.0,
    upscale: bool = True,
) -> dict[Bucket, list[int]]:
    """Item indices grouped by bucket (w, h); only buckets in use, in sorted order.

    `multiple` must keep latents divisible by the UNet's downsampling: pass
    vae_scale * 2 ** (len(unet.block_out_channels) - 1) or a multiple of it (64 for SDXL).
    `upscale` False (ZT_UPSCALE): an image smaller than its bucket gets one of its own size
    (`native_bucket`) instead of being enlarged to cover it.
    """
    sizes = bucket_sizes(resolution, multiple=multiple, max_aspect=max_aspect)
    groups: dict[Bucket, list[int]] = {}
    for index, item in enumerate(items):
        if item is None:  # another dataset's (dataset_buckets)
            continue
        bucket = nearest_bucket(item.size, sizes)
        if not upscale:
            bucket = native_bucket(
                item.size, bucket, resolution=resolution, multiple=multiple, max_aspect=max_aspect
            )
        key = bucket if item.frames == 1 else (*bucket, item.frames)  # clips: by frames too
        groups.setdefault(key, []).append(index)
    return dict(sorted(groups.items()))


def bucket_name(bucket: Bucket) -> str:
    """`96x64`, or a clip bucket's `96x64x17` (width x height x frames)."""
    return "x".join(str(side) for side in bucket)


def dataset_buckets(
    dataset: Dataset,
    resolution: int,
    *,
    multiple: int = 64,
    max_aspect: float = 4.0,
    upscale: bool = True,
) -> dict[Bucket, list[int]]:
    """`assign_buckets` over every dataset of the run at its own resolution, each item listed
    once per repeat: the epoch order (`order.epoch_batches`) then trains it that often."""
    if not dataset.parts:
        return assign_buckets(
            dataset.items, resolution, multiple=multiple, max_aspect=max_aspect, upscale=upscale
        )
    groups: dict[Bucket, list[int]] = {}
    for part in dataset.parts:
        # placeholders keep the joined dataset's indices
        items = [None] * part.start + list(part.dataset.items)
        own = assign_buckets(
            items, part.resolution or resolution, multiple=multiple, max_aspect=max_aspect,
            upscale=upscale,
        )  # fmt: skip
        for size, indices in own.items():
            groups.setdefault(size, []).extend(indices * part.repeats)
    return dict(sorted(groups.items()))
