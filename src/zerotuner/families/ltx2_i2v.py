"""LTX-2 image-to-video (Lightricks/LTX-2 sampled by LTX2ImageToVideoPipeline): LTX-2's
text-to-video network (ltx2.py: the same weights, the video path trained, the audio stream
isolated) generating a clip from its first frame.

A family of its own (`ltx2i2v`) rather than a flag on `ltx2`: its pipeline class is what a
user samples with, its validation samples start from an image, and its objective differs in
three hooks. LTX-2's checkpoints are one repository for both uses, an LTX2Pipeline folder:
read alone (model_index.json, a hub id) it is `ltx2`; ZT_MODEL_FAMILY=ltx2i2v trains it
image-to-video, as `wani2v` does Wan 2.2 TI2V-5B. A folder whose model_index.json names
LTX2ImageToVideoPipeline is `ltx2i2v` by itself.

What it trains on is what LTX2ImageToVideoPipeline samples with (diffusers 0.42,
pipelines/ltx2/pipeline_ltx2_image2video.py):
- `prepare_latents`: the image's latents (the VAE's mode of the image as a one-frame clip,
  normalised by `_normalize_latents`) replace the first latent frame, the conditioning mask is 1
  on that frame's tokens and 0 on the rest; the VAE is causal, so a clip's own first latent
  frame is its first frame's alone (the test holds them equal): nothing is cached beside the
  clip's latents;
- `__call__`: the video tokens' timestep is `t * (1 - mask)`, 0 on the first frame's tokens,
  while `sigma` and the audio stream's timestep are t; the scheduler steps the later frames
  alone (`noise_pred_video[:, :, 1:]`), the first frame kept as given.
So the first latent frame enters clean, its tokens at timestep 0, and the loss is on the later
frames (first_frame.py, as Wan 2.2 TI2V-5B). An image has no later frame: it trains as
text-to-video. The pipeline's optional CRF re-compression of the input image (`image_crf`) is a
sampling-time choice; training sees the clip's own frame.

Lightricks' trainer conditions the same way (Lightricks/LTX-2 at 4e277dd8,
packages/ltx-trainer/src/ltx_trainer/training_strategies/flexible.py: `first_frame`, an
intrinsic condition: the clip's own clean latents on the first frame's tokens, their timesteps
zeroed, left out of the loss mask, sigma unchanged); zerotuner applies it to every clip (its
`probability` 1), as the pipeline always samples from an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.first_frame import FirstFrameKept, first_frame_timesteps, has_later_frames
from zerotuner.families.ltx2 import LTX2, LTX2Objective


@dataclass(frozen=True)
class LTX2I2VObjective(FirstFrameKept, LTX2Objective):
    """LTX-2's flow matching from the clip's first latent frame: kept clean, its tokens at
    timestep 0, the loss on the later frames."""

    def describe(self) -> str:
        return (f"{super().describe()}; the first latent frame kept clean at timestep 0, the "
                f"loss on the later frames (image-to-video)")  # fmt: skip

    def video_timestep(self, t: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        """LTX2ImageToVideoPipeline's `t * (1 - conditioning_mask)`, one per packed token."""
        if not has_later_frames(clip):
            return t
        patch_t, patch = self.patch
        frames, height, width = clip.shape[2:]
        return first_frame_timesteps(t, frames // patch_t, (height // patch) * (width // patch))


@dataclass(frozen=True)
class LTX2I2V(LTX2):
    """LTX-2 from a first frame: LTX-2's conditioning, the first latent frame clean."""

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> LTX2I2VObjective:
        ltx2 = super().objective(settings, scheduler, model_config)
        return LTX2I2VObjective(ltx2.config, patch=ltx2.patch, audio=ltx2.audio)
