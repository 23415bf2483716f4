"""A tiny FLUX.1 Kontext [dev] pipeline and its edit data, built offline from the real
diffusers/transformers classes: flow.py's Flux.1 parts (a FluxTransformer2DModel of one double-
and one single-stream block with the guidance embedding, CLIP-L + T5, the exact 16-channel VAE,
the dynamic-shifting scheduler) saved as a FluxKontextPipeline, which loads, takes an input
image and generates.

The edit it learns is a recolouring: each demo image (`003-red-circle-on-white.png`, captioned
`a red circle on a white background`) gets a control image beside it
(`003-red-circle-on-white.control.png`): the same shape at the same place on the same
background, in the colour before red in RECOLOUR's cycle. The caption names the colour to paint;
the shape, its place and the background are the control's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

# control colour -> the target's: every target is its control with the shape repainted
RECOLOUR = {"blue": "red", "red": "green", "green": "yellow", "yellow": "blue"}


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    """The tiny pipeline in `model_dir` and, with `data_dir`, each demo image's control."""
    from diffusers import FluxKontextPipeline

    from zerotuner.demo.flow import (
        _t5,
        _vae,
        copy_clip_tokenizer,
        flux1_parts,
        write_t5_tokenizer,
    )  # fmt: skip
    from zerotuner.demo.parts import write_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    clip_tokenizer = write_tokenizer(work / "clip", corpus)
    t5_tokenizer = write_t5_tokenizer(work / "t5", corpus)
    vae = _vae(seed, data_dir)  # measured on the targets, before the controls are written
    t5 = _t5(len(t5_tokenizer), seed + 4)
    pipe = FluxKontextPipeline(**flux1_parts(seed, clip_tokenizer, t5_tokenizer, vae=vae, t5=t5))
    pipe.save_pretrained(model_dir, safe_serialization=True)
    copy_clip_tokenizer(work, model_dir, ("tokenizer",))
    if data_dir is not None:
        write_controls(data_dir)
    return model_dir


def write_controls(data_dir: Path) -> list[Path]:
    """Each demo image's control: its shape in the colour RECOLOUR turns into the image's."""
    from zerotuner.demo.pipelines import COLOURS

    before = {target: control for control, target in RECOLOUR.items()}
    written = []
    for target in sorted(data_dir.glob("*.png")):
        colour = next((c for c in COLOURS if f"-{c}-" in target.name), None)
        if colour is None or ".control" in target.name:
            continue
        pixels = np.asarray(Image.open(target).convert("RGB")).copy()
        shape = (pixels == COLOURS[colour]).all(axis=-1)  # the fill is drawn without blending
        pixels[shape] = COLOURS[before[colour]]
        control = target.with_name(f"{target.stem}.control.png")
        Image.fromarray(pixels).save(control, optimize=False)
        written.append(control)
    return written
