"""Which parts of a long clip train (ZT_VIDEO_WINDOWS, or a dataset's `video_windows` in
ZT_DATASETS_FILE): each window is ZT_VIDEO_FRAMES frames sampled at ZT_VIDEO_FPS, and each
trains as an example of its own, so a 30-second clip is not cut to its first seconds.

- `head`: one window from the clip's start (the default; what a clip trained before windows).
- `uniform:N`: N windows spread evenly, the first at the start and the last at the end
  (musubi-tuner's `uniform` frame extraction with `frame_sample`).
- `slide:S`: a window every S sampled frames from the start, as many as fit (musubi-tuner's
  `slide` with `frame_stride`; diffusion-pipe's `multiple_overlapping` with S below the window,
  `chunk` with S equal to it).

A clip shorter than one window trains once, at the longest count the model's frame rule allows
(data/clips.py `trained_frames`), whatever the choice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

CHOICES = (
    "`head`, `uniform:N` (N windows spread over the clip) or `slide:S` (a window every S "
    "sampled frames)"
)
MAX_WINDOWS = 256  # per clip: `uniform:N` at most; `slide` stops there too
_FORM = re.compile(r"^(head|uniform:(\d{1,6})|slide:(\d{1,6}))$")


@dataclass(frozen=True)
class Windows:
    """How a clip is cut into windows; `number` is uniform's count or slide's stride."""

    mode: Literal["head", "uniform", "slide"] = "head"
    number: int = 1

    def __str__(self) -> str:
        return self.mode if self.mode == "head" else f"{self.mode}:{self.number}"

    def starts(self, available: int, frames: int) -> list[int]:
        """The first sampled frame of each window of `frames` frames in a clip of `available`
        sampled frames, in order (one window at 0 when the clip holds no more than one)."""
        room = available - frames  # the last start a whole window fits from
        if self.mode == "head" or room <= 0:
            return [0]
        if self.mode == "uniform":
            if self.number == 1:
                return [0]
            spread = {round(i * room / (self.number - 1)) for i in range(self.number)}
            return sorted(spread)
        return list(range(0, room + 1, self.number))[:MAX_WINDOWS]


HEAD = Windows()


def parse_windows(text: str) -> Windows:
    """`head`, `uniform:N` or `slide:S` as written; ValueError naming the valid forms."""
    match = _FORM.match(text.strip().lower())
    number = int(match[2] or match[3] or 1) if match else 0
    if match is None or number < 1 or (match[2] and number > MAX_WINDOWS):
        raise ValueError(f"{CHOICES}, with N from 1 to {MAX_WINDOWS} and S at least 1")
    if match[1] == "head":
        return HEAD
    return Windows("uniform" if match[2] else "slide", number)
