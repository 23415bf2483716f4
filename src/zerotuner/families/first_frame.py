"""Image-to-video by a clean first latent frame: the clip's own first latent frame is the
condition (a causal video VAE encodes a clip's first frame alone into it, as the pipelines
encode the input image), kept clean in the noisy input, its tokens at timestep 0 and left out of
the loss; the pipeline keeps that frame as it is at every step.

Shared by Wan 2.2 TI2V-5B image-to-video (wan_i2v.py, WanImageToVideoPipeline's
`expand_timesteps`) and LTX-2 image-to-video (ltx2_i2v.py, LTX2ImageToVideoPipeline's
conditioning mask). An image (one frame, or a 4-d latent) has no later frame: it trains as
text-to-video.
"""

from __future__ import annotations

import torch


def has_later_frames(latents: torch.Tensor) -> bool:
    """Whether latents (batch, channels, [frames,] h, w) are a clip with frames after the first."""
    return latents.ndim == 5 and latents.shape[2] > 1


def first_frame_timesteps(t: torch.Tensor, frames: int, tokens_per_frame: int) -> torch.Tensor:
    """(batch, frames * tokens_per_frame): each token's timestep, frame-major as the pipelines
    pack a clip: 0 on the first latent frame's tokens, `t` (batch,) on the others'."""
    later = torch.ones(frames, tokens_per_frame, device=t.device, dtype=t.dtype)
    later[0] = 0
    return later.flatten()[None] * t[:, None]


class FirstFrameKept:
    """The loss hooks of a `flow_matching.FlowObjective` for a clean first latent frame; mixed
    in before the family's objective."""

    def kept_clean(self, latents: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        if not has_later_frames(latents):
            return noisy
        return torch.cat([latents[:, :, :1], noisy[:, :, 1:]], dim=2)

    def scored(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not has_later_frames(target):
            return pred, target
        return pred[:, :, 1:], target[:, :, 1:]
