"""HunyuanVideo 1.5 image-to-video (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v,
-720p_i2v): HunyuanVideo 1.5's transformer (hunyuan_video15.py: the same class, size and
captions) generating a clip from its first frame, sampled by HunyuanVideo15ImageToVideoPipeline.

A family of its own (`hunyuanvideo15i2v`) rather than a flag on `hunyuanvideo15`: its
checkpoints are other weights in their own pipeline folder (model_index.json names the
pipeline, with a SigLIP image encoder and its processor), its validation samples start from an
image, and its objective differs in one hook (`HunyuanVideo15I2VObjective.call`).

What it trains on is what HunyuanVideo15ImageToVideoPipeline samples with (diffusers 0.42,
pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py), its own functions called:
- the image states: `_get_image_embeds` of the clip's first frame (SigLIP's last hidden state
  through its SiglipImageProcessor, 729 x 1152 for the published encoder), the transformer's
  `image_embeds`; cached with the clip's latents (`image_embeds`);
- the condition: `_get_image_latents`, the VAE's mode of the first frame alone times
  `scaling_factor` (the mean: cacheable), cached (`condition_latents`, one latent frame);
  `prepare_cond_latents_and_mask` puts it in the first latent frame of a zero tensor and adds a
  mask channel, 1 on that frame (`first_frame_condition`);
- `__call__`: the transformer's input `cat([noisy, condition, mask], dim=1)`, the timestep on
  the 0-1000 scale; its prediction of every latent frame is stepped (the first one too), so the
  loss is on every frame, as the text-to-video family's (flow matching at its trainer's shift 3).

The model's own trainer conditions the same way (Tencent-Hunyuan/HunyuanVideo-1.5 at 995afc68,
train.py: `get_condition` for task `i2v` puts the clip's first latent frame in the condition's
first frame with a mask channel of 1 there, `encode_images` gives the vision encoder's
`last_hidden_state` of the first frame as `vision_states`, the MSE is over the whole prediction).
It draws i2v for a share of its clips (`i2v_prob`) and trains images as text-to-video
(`sample_task`); zerotuner trains every clip image-to-video (what the pipeline samples) and an
image, which has no later frame, as text-to-video: zero condition, mask and image states, as
hunyuan_video15.py. The cache holds the first frame's latents encoded alone, as the pipeline
encodes the input image, where the trainer takes the clip's own first latent frame (the same
for the causal VAE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotuner.families.first_frame import has_later_frames
from zerotuner.families.hunyuan_video15 import HunyuanVideo15, HunyuanVideo15Objective
from zerotuner.families.image_encoder import first_frames_uint8, load_image_encoder


def first_frame_condition(condition: torch.Tensor, frames: int) -> torch.Tensor:
    """HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask's tensors, concatenated:
    the first frame's latents (batch, c, 1, h, w) in the first of `frames` latent frames, zeros
    after, and a mask channel, 1 on that frame: (batch, c + 1, frames, h, w)."""
    batch, channels, _, height, width = condition.shape
    out = condition.new_zeros(batch, channels + 1, frames, height, width)
    out[:, :channels, :1] = condition[:, :, :1]
    out[:, channels, 0] = 1
    return out


@dataclass(frozen=True)
class HunyuanVideo15I2VObjective(HunyuanVideo15Objective):
    """HunyuanVideo 1.5's flow matching with the first frame's condition latents and mask beside
    the noisy clip and SigLIP's states of that frame (`condition`, `image_embeds` in the
    kwargs); an image trains as text-to-video."""

    def describe(self) -> str:
        return (f"{super().describe()}; the first frame's latents, mask and image states beside "
                f"the noise (image-to-video)")  # fmt: skip

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        rest = dict(kwargs)
        condition, vision = rest.pop("condition"), rest.pop("image_embeds")
        if not has_later_frames(latents):  # the trainer's `sample_task`: an image is t2v
            return super().call(model, latents, t, rest)
        condition = condition.unsqueeze(2) if condition.ndim == 4 else condition
        condition = first_frame_condition(condition.to(latents), latents.shape[2])
        inputs = torch.cat([latents, condition], dim=1)
        return model(hidden_states=inputs, timestep=t, image_embeds=vision.to(latents),
                     return_dict=False, **rest)[0]  # fmt: skip


@dataclass(frozen=True)
class HunyuanVideo15I2V(HunyuanVideo15):
    """HunyuanVideo 1.5 from a first frame: its conditioning, the first frame's latents and
    SigLIP states."""

    def trains(self, parameter: str) -> bool:
        return True  # the image projection reads the first frame's states

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        width = int(model_config.get("image_embed_dim", 1152))
        return HunyuanVideo15I2VObjective(self.flow_config(settings, scheduler), image_width=width)

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {**super().model_kwargs(batch, dtype),
                "condition": batch["condition_latents"].to(dtype),
                "image_embeds": batch["image_embeds"].to(dtype)}  # fmt: skip

    def latent_subfolders(self) -> list[str]:
        """The image encoder's states are in a latents entry: its files are in the key."""
        return [*super().latent_subfolders(), "image_encoder", "feature_extractor"]

    def latent_cache_tag(self) -> str:
        return ":i2v"  # the condition latents are in the entry: another than hunyuanvideo15's

    def load_image_encoder(self, source: Path, device: torch.device) -> Any:
        """Its SigLIP vision model and SiglipImageProcessor (`feature_extractor`)."""
        return load_image_encoder(source, device, "feature_extractor")

    @torch.no_grad()
    def encode_conditions(
        self,
        pixels: torch.Tensor,
        encode: Callable[[torch.Tensor], torch.Tensor],
        image_encoder: Any = None,
    ) -> dict[str, torch.Tensor]:
        """A batch of clips (batch, 3, frames, h, w; images: batch, 3, h, w) in [-1, 1]: the first
        frame's latents encoded alone (`_get_image_latents`; an image's: its own) and SigLIP's
        states of it (`_get_image_embeds`)."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline as Pipeline

        image = pixels.ndim == 4
        clip = pixels.unsqueeze(2) if image else pixels
        latents = encode(clip[:, :, :1])
        encoder, processor = image_encoder
        states = Pipeline._get_image_embeds(
            image_encoder=encoder, feature_extractor=processor, image=first_frames_uint8(clip),
            device=encoder.device,
        )  # fmt: skip
        return {"condition_latents": latents.squeeze(2) if image else latents,
                "image_embeds": states.float().cpu()}  # fmt: skip
