"""A tiny Qwen-Image-Edit Plus pipeline and its edit data with two references per target, built
offline from the real diffusers/transformers classes: qwen_image_edit.py's parts (its
transformer, VAE, Qwen2.5-VL with a vision tower, torchvision-free processor) saved as a
QwenImageEditPlusPipeline, which loads, takes a list of input images and generates.

The edit it learns is flux_kontext.py's recolouring, with the colour shown as well as named:
each demo image's first reference (`foo.control.png`) is its shape in the colour before the
target's in RECOLOUR's cycle, its second (`foo.control_1.png`) a swatch of the target's colour,
the size of the image (a reference is cropped with its target: the scan wants its aspect ratio).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from zerotuner.demo.qwen_image_edit import TEMPLATE_WORDS

# QwenImageEditPlusPipeline's "Picture N: " before each reference: the word and the numbers
PICTURE_WORDS, PICTURE_MARKS = "picture", ("1", "2", "3")


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    """The tiny pipeline in `model_dir` and, with `data_dir`, each demo image's references."""
    from diffusers import QwenImageEditPlusPipeline

    from zerotuner.demo.qwen_image_edit import write_edit_model

    return write_edit_model(
        model_dir, QwenImageEditPlusPipeline, seed=seed, corpus=corpus, data_dir=data_dir,
        write_data=write_references, words=f"{TEMPLATE_WORDS} {PICTURE_WORDS}",
        marks=(",", ":", ".", "(", ")", "'", *PICTURE_MARKS),
    )  # fmt: skip


def write_references(data_dir: Path) -> list[Path]:
    """Each demo image's two references: flux_kontext.py's control (the shape to repaint) and
    a swatch of the colour to paint it."""
    from zerotuner.demo.flux_kontext import write_controls
    from zerotuner.demo.pipelines import COLOURS

    written = []
    for control in write_controls(data_dir):
        target = control.with_name(control.name.replace(".control.png", ".png"))
        colour = next(c for c in COLOURS if f"-{c}-" in target.name)
        with Image.open(target) as image:
            size = image.size
        swatch = np.full((size[1], size[0], 3), COLOURS[colour], dtype=np.uint8)
        second = control.with_name(control.name.replace(".control.png", ".control_1.png"))
        Image.fromarray(swatch).save(second, optimize=False)
        written += [control, second]
    return written
