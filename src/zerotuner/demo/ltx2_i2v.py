"""A tiny LTX-2 image-to-video pipeline: demo/ltx2.py's parts (LTX-2 samples from an image with
the same network and components) saved as an LTX2ImageToVideoPipeline, which generates a clip
from an input image.
"""

from __future__ import annotations

from pathlib import Path

from zerotuner.demo.ltx2 import write_ltx2


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    from diffusers import LTX2ImageToVideoPipeline

    return write_ltx2(model_dir, LTX2ImageToVideoPipeline, seed=seed, corpus=corpus,
                      data_dir=data_dir)  # fmt: skip
