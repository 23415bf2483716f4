"""The LoRA demo's new concept: shapes in a colour the demo base never saw, behind a trigger word.

A LoRA adapts a model that already knows something; on a randomly initialised base its adapters
cannot teach the convolutions to denoise (issue 33 measured it). So `make run-lora` adapts the
UNet `make run` trained, which draws the demo's red, green, blue and yellow shapes, to one more
colour, named by DreamBooth's rare trigger word: "a sks circle on a white background" is a
magenta circle. The base draws something else for "sks"; the adapter learns it. Beside the
concept the folder holds as many of the base's own shapes (DreamBooth's prior preservation:
without them the adapter learns "everything is magenta"), so prompts without the word stay as
the base draws them.
"""

from __future__ import annotations

import random
from pathlib import Path

from zerotuner.demo.pipelines import BACKGROUNDS, COLOURS, SHAPES, draw_shape

TRIGGER = "sks"
COLOUR = (230, 40, 200)  # magenta: none of the base's colours, nor a mix the base draws


def concept_caption(shape: str, background: str) -> str:
    return f"a {TRIGGER} {shape} on a {background} background"


def write_concept_dataset(data_dir: Path, *, seed: int = 0, count: int = 27) -> Path:
    """`count` square images of the concept (every shape on every background in turn) and as
    many of the base's colours, drawn anew."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1000)  # not the base dataset's shapes
    combos = [(s, b) for s in SHAPES for b in BACKGROUNDS]
    colours = list(COLOURS)
    for i in range(count):
        shape, background = combos[i % len(combos)]
        for name, fill, caption in (
            (TRIGGER, COLOUR, concept_caption(shape, background)),
            (colour := colours[i % len(colours)], COLOURS[colour],
             f"a {colour} {shape} on a {background} background"),
        ):  # fmt: skip
            image = draw_shape(rng, (96, 96), shape, fill, BACKGROUNDS[background])
            stem = data_dir / f"{i:03d}-{name}-{shape}-on-{background}"
            image.save(stem.with_suffix(".png"), optimize=False)
            stem.with_suffix(".txt").write_text(caption)
    return data_dir
