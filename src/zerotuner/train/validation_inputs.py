"""The input image of each validation sample, for the families that sample from one (Wan
image-to-video: the clip's first frame; FLUX.1 Kontext: the image to edit): ZT_VALIDATION_IMAGES,
one image per validation prompt (or one for every prompt; a model of several references,
Qwen-Image-Edit Plus and FLUX.2, takes a list of them per prompt), else the training data's own.

ZT_VALIDATION_IMAGES lists paths as the container sees them, comma-separated or as a JSON list
(an entry a path or a list of paths); a relative path is read under ZT_DATA_DIR when that is a
local folder. Each is probed as a training image is
(data.probe: unreadable, truncated, not PNG/JPEG/WebP, a link out of its folder...) before any
training: a missing or unusable one is one line, exit 2, with nothing trained or overwritten.

Unset, a family that samples from an input takes its first training item's (the first in the
scanned order, held-out images aside): Wan I2V the first frame of the first clip (of the first
image when the data hold no clip), Kontext the first control image of the first pair; every
prompt samples from it, and the log names it. FLUX.2 samples from an input where its data have
reference images (Spec.run_sample_input), from its prompts alone where they have none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import ConfigError
from zerotuner.settings.schema import env_name

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

    from zerotuner.data.dataset import Dataset, Item

log = logging.getLogger(__name__)


def check(settings: Any, sample_input: str, most: int = 1) -> list[list[Path]]:
    """ZT_VALIDATION_IMAGES's paths per prompt, each probed; one line, exit 2, for the setting
    given to a family that samples without an input, a count that is neither 1 nor the
    prompts', more images for one prompt than the model takes (`most`: its most control images,
    1 for a first frame), or an image that cannot be read. Preflight's model step runs it
    (every command refuses as train does, train before its ranks start); the ranks again as
    they read the images."""
    from zerotuner.data.probe import probe

    name = env_name("validation_images")
    given = settings.validation_image_paths
    if given and not sample_input:
        raise ConfigError(
            f"{name} is set but the model samples from its prompts alone: unset {name} (it "
            f"applies to the models that sample from an input image: Wan image-to-video, FLUX.1 "
            f"Kontext, FLUX.2 trained with reference images)"
        )
    prompts = len(settings.validation_prompts)
    if given and prompts and len(given) not in (1, prompts):
        raise ConfigError(
            f"{name}: {len(given)} images for {prompts} validation prompts; give one image per "
            f"prompt (in the prompts' order), or one for all of them"
        )
    for group in given:
        if len(group) > most:
            raise ConfigError(
                f"{name}: {len(group)} images for one prompt ({', '.join(map(str, group))}); "
                f"the model takes at most {most} {sample_input}{'s' * (most > 1)} a sample"
            )
        for path in group:
            found = probe(path, None)
            if found.reason:
                raise ConfigError(f"{name}: {path}: {found.reason}; give an image the job can read")
    return given


def chosen(
    settings: Any, sample_input: str, dataset: Dataset, held: list[int], most: int = 1
) -> list[PILImage | list[PILImage]] | None:
    """The input image of each validation prompt (a list: its several references; None: the
    family samples without one), refused as `check` refuses."""
    name = env_name("validation_images")
    given = check(settings, sample_input, most)
    if not sample_input or not settings.validation_prompts:
        return None
    prompts = len(settings.validation_prompts)
    if given:
        images: list[PILImage | list[PILImage]] = [
            read(group[0], name) if len(group) == 1 else [read(path, name) for path in group]
            for group in given
        ]
        return images * prompts if len(images) == 1 else images
    image, source = from_data(sample_input, dataset, held)
    log.info("samples: every prompt samples from %s (%s; %s sets others)", source,
             sample_input, name)  # fmt: skip
    return [image] * prompts


def read(path: Path, name: str) -> PILImage:
    """An input image, probed as a training image is; RGB."""
    from PIL import Image, ImageOps

    from zerotuner.data.probe import probe

    found = probe(path, None)
    if found.reason:
        raise ConfigError(f"{name}: {path}: {found.reason}; give an image the job can read")
    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def from_data(
    sample_input: str, dataset: Dataset, held: list[int]
) -> tuple[PILImage | list[PILImage], str]:
    """The first training item's input: a clip's first frame (`first frame`) or a pair's
    control image (`control image`; an item of several, Qwen-Image-Edit Plus's, all of them:
    the pipeline's `image` list), and the file(s) it came from."""
    out = set(held)
    items = [item for i, item in enumerate(dataset.items) if i not in out] or dataset.items
    if not items:
        raise ConfigError("no training item to take a validation input image from")
    if sample_input == "control image":
        item = next((i for i in items if i.controls), items[0])
        if not item.controls:
            raise ConfigError(f"no control image in the data; set {env_name('validation_images')}")
        if len(item.controls) > 1:  # Qwen-Image-Edit Plus: every reference, in order
            images = [read(path, env_name("validation_images")) for path in item.controls]
            return images, ", ".join(map(str, item.controls))
        return read(item.controls[0], env_name("validation_images")), str(item.controls[0])
    item = next((i for i in items if i.frames > 1), items[0])
    return first_frame(item), f"the first frame of {item.path}"


def first_frame(item: Item) -> PILImage:
    """A training item's first frame at its own size (a clip's first sampled frame)."""
    from PIL import Image

    from zerotuner.data import clips

    if item.frames <= 1 and not item.fps:
        return read(item.path, env_name("validation_images"))
    (frame,) = clips.sample_frames(item.path, fps=item.fps, frames=1, start=item.start)
    return Image.fromarray(frame).convert("RGB")
