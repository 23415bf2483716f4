"""Wan image-to-video (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, -720P, Wan2.2-I2V-A14B-Diffusers):
Wan's text-to-video transformer (wan.py) that also sees the clip's first frame. Its pipeline is
WanImageToVideoPipeline; its transformer takes 36 channels (16 noisy latents, 4 mask channels,
16 condition latents) and, for Wan 2.1, the first frame's CLIP image states through its
`added_kv_proj` cross-attention (`image_dim` set); Wan 2.2 I2V A14B has no image encoder and
two experts, trained one per run as its text-to-video sibling (ZT_EXPERT, `Wan.configured`).

A family of its own (`wani2v`) rather than a flag on `wan`: its pipeline class is what
model_index.json names and what a user samples with, its data are clips whose first frame is
the input, and its objective differs in one hook (`WanI2VObjective.call`).

What it trains on is what WanImageToVideoPipeline samples with (diffusers 0.42, pipelines/wan/
pipeline_wan_i2v.py, `prepare_latents`, `encode_image`, `__call__`):
- the condition latents: the VAE's mode of [first frame, zeros for every other frame] (the
  distribution's mean: cacheable), normalised `(x - latents_mean) / latents_std` as the clip's
  own latents; cached with the clip's latents (`condition_latents`, and their mirror image);
- the mask: 1 on the first latent frame (the first frame repeated over the VAE's 4-frame
  temporal step, folded into 4 channels), 0 on the rest; built at each step, not cached;
- the transformer's input `cat([noisy, mask, condition], dim=1)`, its output the clip's 16
  channels; the loss is Wan's flow matching on every latent frame (the first one too, as the
  pipeline denoises it and musubi-tuner trains it);
- Wan 2.1's image states: its image encoder's (CLIPVisionModel) penultimate hidden states
  of the first frame through its CLIPImageProcessor, passed as
  `encoder_hidden_states_image`; cached with the clip's latents (they depend on its first frame,
  not on its caption).

Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers: a WanPipeline whose model_index.json says
`expand_timesteps`) is both: read as `wan` it trains text-to-video; ZT_MODEL_FAMILY=wani2v trains
it image-to-video as WanImageToVideoPipeline samples it with `expand_timesteps` (`__call__`):
no condition channels, the clip's first latent frame kept clean in the noisy input (the VAE is
causal: a clip's first latent frame is its first frame's alone, the pipeline's condition), that
frame's tokens at timestep 0 and the others at t (one timestep per token), and the loss on the
other frames (the pipeline replaces the first frame's prediction with the condition). An image
has no later frame: it trains as text-to-video.

musubi-tuner does the same (kohya-ss/musubi-tuner at 30c658c4, src/musubi_tuner/
wan_cache_latents.py `encode_and_save_batch`: `msk` and `y = vae.encode([frame, zeros])`
concatenated as `4 + C` channels and `clip.visual` of the first frame, both cached with the
latents; wan_train_network.py passes them as `y` and `clip_fea`); finetrainers' Wan I2V
(a-r-r-o-w/finetrainers, finetrainers/models/wan/base_specification.py) encodes the same
`[first frame, zeros]` condition with the mask.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from zerotuner.families.first_frame import FirstFrameKept, first_frame_timesteps, has_later_frames
from zerotuner.families.image_encoder import first_frames_uint8, load_image_encoder
from zerotuner.families.wan import Wan, WanObjective

MASK_CHANNELS = 4  # the first frame's mask: one channel per frame the VAE folds into one


def first_frame_mask(condition: torch.Tensor, channels: int = MASK_CHANNELS) -> torch.Tensor:
    """WanImageToVideoPipeline's mask for condition latents (batch, c, frames, h, w): (batch,
    `channels`, frames, h, w), ones on the first latent frame, zeros on the rest (the pipeline
    repeats the first frame's 1 over the VAE's temporal step and folds each step's frames into
    channels: one per frame folded, 4 for Wan's VAE)."""
    batch, _, frames, height, width = condition.shape
    mask = condition.new_zeros(batch, channels, frames, height, width)
    mask[:, :, 0] = 1
    return mask


def condition_pixels(clip: torch.Tensor) -> torch.Tensor:
    """What the pipeline encodes as the condition: the clip's first frame, then zeros."""
    condition = torch.zeros_like(clip)
    condition[:, :, :1] = clip[:, :, :1]
    return condition


@dataclass(frozen=True)
class WanI2VObjective(WanObjective):
    """Wan's flow matching with the first frame's condition latents (`condition`, in the
    kwargs) and their mask concatenated to the noisy clip on the channels. `mask_channels`: the
    transformer's inputs less twice its outputs (4: 36 = 16 + 4 + 16)."""

    mask_channels: int = MASK_CHANNELS

    def describe(self) -> str:
        return (f"{super().describe()}; the first frame's latents and mask beside the noise "
                f"(image-to-video)")  # fmt: skip

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        rest = dict(kwargs)
        condition = rest.pop("condition")
        image = latents.ndim == 4  # an image trains as a one-frame clip (its own first frame)
        clip = latents.unsqueeze(2) if image else latents
        condition = condition.unsqueeze(2) if condition.ndim == 4 else condition
        condition = condition.to(clip.device, clip.dtype)
        inputs = torch.cat(
            [clip, first_frame_mask(condition, self.mask_channels), condition], dim=1
        )
        out = model(hidden_states=inputs, timestep=t, **rest).sample
        return out.squeeze(2) if image else out


@dataclass(frozen=True)
class WanTI2VObjective(FirstFrameKept, WanObjective):
    """Wan 2.2 TI2V-5B's image-to-video flow matching (`expand_timesteps`): the first latent
    frame clean, timestep 0 on its tokens, the loss on the later frames (first_frame.py)."""

    def describe(self) -> str:
        return (f"{super().describe()}; the first latent frame kept clean at timestep 0, the "
                f"loss on the later frames (image-to-video, expand_timesteps)")  # fmt: skip

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        if not has_later_frames(latents):
            return super().call(model, latents, t, kwargs)
        return model(hidden_states=latents, timestep=token_timesteps(latents, t), **kwargs).sample


def token_timesteps(latents: torch.Tensor, t: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """(batch, tokens): each token's timestep as WanImageToVideoPipeline's `expand_timesteps`
    gives it, 0 on the first latent frame's tokens (its mask `[:, ::2, ::2]`), t elsewhere."""
    frames, height, width = latents.shape[2:]
    return first_frame_timesteps(t, frames, -(-height // patch) * -(-width // patch))


@dataclass(frozen=True)
class WanI2V(Wan):
    """Wan image-to-video: Wan's conditioning, the first frame's latents and (2.1) CLIP states."""

    # Wan 2.2 TI2V-5B (model_index.json `expand_timesteps`): the first latent frame conditions
    expand_timesteps: bool = False

    def configured(self, settings: Any, source: Path | None = None) -> Any:
        family = super().configured(settings, source)
        index = source / "model_index.json" if source is not None else None
        if index is None or not index.is_file():
            return family
        expand = bool(json.loads(index.read_text()).get("expand_timesteps"))
        return replace(family, expand_timesteps=expand)

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        wan = super().objective(settings, scheduler, model_config)
        if self.expand_timesteps:
            return WanTI2VObjective(wan.config, expert=wan.expert, expert_range=wan.expert_range)
        mask = int(model_config.in_channels) - 2 * int(model_config.out_channels)
        return WanI2VObjective(wan.config, expert=wan.expert, expert_range=wan.expert_range,
                               mask_channels=mask)  # fmt: skip

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        kwargs = super().model_kwargs(batch, dtype)
        if self.expand_timesteps:  # TI2V-5B: the clip's own first latent frame conditions
            return kwargs
        kwargs["condition"] = batch["condition_latents"].to(dtype)
        if "image_embeds" in batch:  # Wan 2.1: the transformer's image_dim is set
            kwargs["encoder_hidden_states_image"] = batch["image_embeds"].to(dtype)
        return kwargs

    def latent_subfolders(self) -> list[str]:
        """The image encoder's states are in a latents entry: its files are in the key."""
        return [*super().latent_subfolders(), "image_encoder", "image_processor"]

    def latent_cache_tag(self) -> str:
        # the condition latents are in the entry: another than wan's (TI2V-5B's holds none)
        return "" if self.expand_timesteps else ":i2v"

    def load_image_encoder(self, source: Path, device: torch.device) -> Any:
        """Wan 2.1's image encoder and its processor, or None (Wan 2.2 I2V A14B: none)."""
        return load_image_encoder(source, device, "image_processor")

    @torch.no_grad()
    def encode_conditions(
        self,
        pixels: torch.Tensor,
        encode: Callable[[torch.Tensor], torch.Tensor],
        image_encoder: Any = None,
    ) -> dict[str, torch.Tensor]:
        """A batch of clips (batch, 3, frames, h, w; images as one frame) in [-1, 1]: their
        condition latents (the VAE's, normalised as the clips' own) and, with Wan 2.1's image
        encoder, its penultimate states of the first frame (`WanImageToVideoPipeline.
        encode_image`)."""
        if self.expand_timesteps:  # TI2V-5B: nothing beside the clip's latents
            return {}
        image = pixels.ndim == 4
        clip = pixels.unsqueeze(2) if image else pixels
        latents = encode(condition_pixels(clip))
        out = {"condition_latents": latents.squeeze(2) if image else latents}
        if image_encoder is not None:
            encoder, processor = image_encoder
            inputs = processor(images=first_frames_uint8(clip), return_tensors="pt")
            inputs = inputs.to(encoder.device)
            states = encoder(**inputs, output_hidden_states=True).hidden_states[-2]
            out["image_embeds"] = states.float().cpu()
        return out
