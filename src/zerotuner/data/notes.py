"""What this run's settings do to a scanned dataset, in lines for `check` and the training log:
the images enlarged to cover their bucket (`upscale_warning`) and the recipes in force
(`recipe_notes`). `check` and rank 0 call both with the same bucket step, so they agree.
"""

from __future__ import annotations

from zerotuner.data.buckets import bucket_sizes, dataset_buckets
from zerotuner.data.dataset import Dataset, count
from zerotuner.data.scan import SMALL

UPSCALE_NOTICE = 1.1  # enlarging an image by more than this is worth a warning


def upscale_warning(
    dataset: Dataset, resolution: int, *, multiple: int = 64, upscale: bool = True
) -> str | None:
    """A line saying how many images are enlarged by more than 10% to cover their bucket at
    this resolution, and by how much at most (upscaled images teach blur); None if none.
    With `upscale` False only images with a side below one bucket step are enlarged."""
    buckets = dataset_buckets(dataset, resolution, multiple=multiple, upscale=upscale)
    scales = [
        max(bucket[0] / dataset.items[i].size[0], bucket[1] / dataset.items[i].size[1])
        for bucket, indices in buckets.items()
        for i in set(indices)  # an image repeated is enlarged once
    ]
    upscaled = [scale for scale in scales if scale > UPSCALE_NOTICE]
    if not upscaled:
        return None
    if not upscale:
        return (
            f"{len(upscaled)} of {len(scales)} images have a side below the bucket step "
            f"{multiple} px and will be upscaled to it (up to {max(upscaled):.1f}x) despite "
            f"ZT_UPSCALE=false: leave them out with ZT_MIN_IMAGE_SIZE={multiple}"
        )
    return (
        f"{len(upscaled)} of {len(scales)} images are smaller than {resolution} px and will be "
        f"upscaled (up to {max(upscaled):.1f}x): use larger images or a lower ZT_RESOLUTION, "
        "train them at their own size (ZT_UPSCALE=false) or leave them out (ZT_MIN_IMAGE_SIZE)"
    )


def recipe_notes(
    dataset: Dataset,
    resolution: int | None,
    *,
    multiple: int = 64,
    caption_template: str | None = None,
    caption_dropout: float = 0.0,
    min_image_size: int = 0,
    upscale: bool = True,
    timestep_range: str | None = None,
) -> list[str]:
    """What the recipes in force do to this dataset, a few words each (for `check` and the
    log): the caption template, the dropout, the images left out or kept at their size, the
    part of the noise schedule trained."""
    notes = []
    if caption_template:
        notes.append(f"captions as {caption_template!r}")
    if caption_dropout:
        notes.append(f"{caption_dropout * 100:g}% of samples an epoch on the empty caption")
    if min_image_size:
        small = sum(why.startswith(SMALL) for _, why in dataset.skipped)
        notes.append(f"{count(small, 'image')} under {min_image_size} px left out")
    if not upscale and resolution:
        standard = set(bucket_sizes(resolution, multiple=multiple))
        buckets = dataset_buckets(dataset, resolution, multiple=multiple, upscale=False)
        native = sum(len(set(ix)) for size, ix in buckets.items() if size[:2] not in standard)
        its = "its" if native == 1 else "their"
        notes.append(f"{count(native, 'image')} not upscaled (trained at {its} own size)")
    if timestep_range:
        notes.append(f"noise schedule {timestep_range} only")
    if masked := sum(item.mask is not None for item in dataset.items):
        notes.append(f"{count(masked, 'image')} with a loss mask")
    return notes
