"""LTX-2 text-to-video (Lightricks/LTX-2): an audio-video DiT (LTX2VideoTransformer3DModel: a
video stream and an audio stream in each block, cross-attention to the text and between the two
streams) conditioned on Gemma 3's hidden states of every layer through LTX2TextConnectors, with a
causal video VAE (AutoencoderKLLTX2Video: 32 pixels and 8 frames per latent cell, latents
normalised by its per-channel `latents_mean` / `latents_std` buffers), an audio VAE and a
vocoder, and a flow-matching Euler scheduler with dynamic shifting.

zerotuner trains the video path and leaves the audio out: the user's clips may have no sound,
and the reference trainer's video-only modes (Lightricks/LTX-2 at ec11c166,
packages/ltx-trainer/docs/training-modes.md: a strategy without an `audio` block loads no audio
latents and the model runs without the audio modality) train the same way. The transformer
always runs both streams, so the video stream is isolated from the audio one as the pipeline's
own modality-isolation pass does (`isolate_modalities=True`: no audio-to-video or video-to-audio
attention), the audio stream given one silent token, its output dropped. No gradient reaches the
audio stream: a full fine-tuning freezes it (`trains`), the export keeps it as it was, and
LTX2Pipeline still renders the sound.

What it trains on is what LTX2Pipeline samples with (diffusers 0.42, pipelines/ltx2/
pipeline_ltx2.py):
- captions: `_get_gemma_prompt_embeds` (stripped, Gemma tokens padded on the left to
  max_sequence_length, default 1024, every layer's hidden state stacked and flattened), then the
  connectors (`LTX2TextConnectors`, frozen) as `__call__` runs them: their video output and mask
  are what the transformer reads (`encoder_hidden_states`, `encoder_attention_mask`), cached;
- latents `(x - latents_mean) * scaling_factor / latents_std` (`_normalize_latents`), a clip (an
  image as one frame), packed as `_pack_latents` packs them;
- the transformer takes the timestep on the 0-1000 scale (as `timestep` and `sigma`), the clip's
  latent frames, height and width, and the frame rate its RoPE positions are scaled by (the
  pipeline's default, 24 fps).

The noise schedule is the reference trainer's (packages/ltx-trainer/src/ltx_trainer/
timestep_samplers.py at 32ac2e19, `ShiftedLogitNormalTimestepSampler`, its default): sigma =
sigmoid(n * std + mu), mu from the clip's token count (0.95 at 1024 tokens to 2.05 at 4096,
capped there), stretched between the normal's 0.5th and 99.9th percentiles to cover [0, 1], a
tenth of the draws uniform; the input `(1 - sigma) x + sigma n`, the target `n - x`.
ZT_WEIGHTING_SCHEME=logit_normal (the default) is that sampler with ZT_LOGIT_MEAN added to mu
and ZT_LOGIT_STD as its std; `uniform` and `mode` draw as for the other families.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from zerotuner.families.base import ComfyLora, ModelFamily
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective

FPS = 24.0  # LTX2Pipeline's default frame rate: the RoPE positions of a clip's frames
# The reference's shift by tokens (ltx-trainer `_get_shift_for_sequence_length`'s defaults)
SHIFT_TOKENS, SHIFT_RANGE = (1024, 4096), (0.95, 2.05)
PERCENTILES = (-2.5758, 3.0902)  # the standard normal's 0.5th and 99.9th percentiles
UNIFORM_SHARE, EPS = 0.1, 1e-3


def ltx2_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """A clip (batch, channels, frames, h, w) or images (batch, channels, h, w) in [-1, 1] ->
    LTX2Pipeline's normalised latents (`_normalize_latents`: the VAE's per-channel buffers)."""
    frames = pixels.ndim == 5
    clip = pixels.to(vae.device, vae.dtype)
    clip = clip if frames else clip[:, :, None]
    latents = vae.encode(clip).latent_dist.mean.float().cpu()
    mean = vae.latents_mean.float().cpu().view(1, -1, 1, 1, 1)
    std = vae.latents_std.float().cpu().view(1, -1, 1, 1, 1)
    latents = (latents - mean) * float(vae.config.scaling_factor) / std
    return latents if frames else latents[:, :, 0]


def token_shift(tokens: int) -> float:
    """mu of the reference's sampler: linear in the clip's tokens, from 0.95 at 1024 to 2.05
    at 4096 (and beyond)."""
    (low, high), (shift_low, shift_high) = SHIFT_TOKENS, SHIFT_RANGE
    slope = (shift_high - shift_low) / (high - low)
    return shift_low + slope * (min(tokens, high) - low)


def shifted_logit_normal(
    batch: int, tokens: int, generator: torch.Generator, *, mean: float = 0.0, std: float = 1.0
) -> torch.Tensor:
    """The reference trainer's sigmas for clips of `tokens` tokens (see the module's note)."""
    mu = token_shift(tokens) + mean
    drawn = torch.sigmoid(torch.randn(batch, generator=generator) * std + mu)
    low, high = (torch.sigmoid(torch.tensor(mu + p * std)) for p in PERCENTILES)
    stretched = (drawn - low) / (high - low)
    stretched = torch.where(stretched >= EPS, stretched, 2 * EPS - stretched).clamp(0, 1)
    uniform = (1 - EPS) * torch.rand(batch, generator=generator) + EPS
    return torch.where(torch.rand(batch, generator=generator) > UNIFORM_SHARE, stretched, uniform)


@dataclass(frozen=True)
class LTX2Objective(FlowObjective):
    """Flow matching on LTX2VideoTransformer3DModel's packed clip, the video stream alone."""

    patch: tuple[int, int] = (1, 1)  # the transformer's (patch_size_t, patch_size)
    # the transformer's audio input channels, and the width of the audio text it takes (the
    # caption's with LTX-2.0's caption projection, else audio_cross_attention_dim)
    audio: tuple[int, int] = (128, 3840)

    def describe(self) -> str:
        c = self.config
        if c.weighting != "logit_normal":
            return super().describe()
        low, high = c.timestep_range
        part = "" if (low, high) == (0.0, 1.0) else f", sigmas in {low:g}-{high:g}"
        return (f"flow matching (sigmas: LTX-2's shifted logit_normal({c.logit_mean:g}, "
                f"{c.logit_std:g}) by tokens{part})")  # fmt: skip

    def sigmas(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """ltx-trainer's logit-normal, shifted by the clip's token count; another
        ZT_WEIGHTING_SCHEME samples as every flow family does."""
        c = self.config
        if c.weighting != "logit_normal":
            return super().sigmas(latents, generator)
        frames = latents.shape[2] if latents.ndim == 5 else 1
        tokens = frames * latents.shape[-2] * latents.shape[-1]
        tokens //= self.patch[0] * self.patch[1] ** 2
        drawn = shifted_logit_normal(latents.shape[0], tokens, generator,
                                     mean=c.logit_mean, std=c.logit_std)  # fmt: skip
        low, high = c.timestep_range
        return low + (high - low) * drawn

    def predict(
        self,
        model: Any,
        noisy: torch.Tensor,
        sigmas: torch.Tensor,
        kwargs: dict[str, Any],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The video velocity for noised latents (batch, channels, [frames,] h, w), as
        LTX2Pipeline's transformer call computes it, the audio stream isolated."""
        from diffusers import LTX2Pipeline

        image = noisy.ndim == 4
        clip = noisy[:, :, None] if image else noisy
        batch, _, frames, height, width = clip.shape
        patch_t, patch = self.patch
        packed = LTX2Pipeline._pack_latents(clip, patch, patch_t).to(device, dtype)
        t = (sigmas * self.config.num_train_timesteps).to(device, dtype)
        # one silent audio token and its one text token: the stream the video is isolated from
        audio = torch.zeros(batch, 1, self.audio[0], device=device, dtype=dtype)
        audio_text = torch.zeros(batch, 1, self.audio[1], device=device, dtype=dtype)
        out = model(
            hidden_states=packed, audio_hidden_states=audio,
            timestep=self.video_timestep(t, clip), audio_timestep=t, sigma=t,
            audio_encoder_hidden_states=audio_text, num_frames=frames // patch_t,
            height=height // patch, width=width // patch, fps=FPS, audio_num_frames=1,
            isolate_modalities=True, use_cross_timestep=True, return_dict=False, **kwargs,
        )[0]  # fmt: skip
        pred = LTX2Pipeline._unpack_latents(out, frames // patch_t, height // patch,
                                            width // patch, patch, patch_t)  # fmt: skip
        return pred[:, :, 0] if image else pred

    def video_timestep(self, t: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        """The timestep of the clip's (batch, channels, frames, h, w) video tokens: each
        example's `t` (image-to-video: one per token, ltx2_i2v.py)."""
        return t


# LTX-2's diffusers module names to the original checkpoint's, which ComfyUI's LTX-2 model has
# and the reference trainer's adapters use (`diffusion_model.` before them): the inverse of
# diffusers' LTX_2_0_TRANSFORMER_KEYS_RENAME_DICT and its adaln_single handling (diffusers 0.42
# loaders/lora_conversion_utils.py `_convert_non_diffusers_ltx2_lora_to_diffusers`, as
# scripts/convert_ltx2_to_diffusers.py), for the layers LoRA wraps; attention and feed-forward
# names are the same in both
LTX2_ORIGINAL_NAMES = (
    ("proj_in", "patchify_proj"), ("audio_proj_in", "audio_patchify_proj"),
    ("time_embed", "adaln_single"), ("audio_time_embed", "audio_adaln_single"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("prompt_adaln", "prompt_adaln_single"), ("audio_prompt_adaln", "audio_prompt_adaln_single"),
)  # fmt: skip


@dataclass(frozen=True)
class LTX2(FlowFamily):
    comfy_lora: ComfyLora = ComfyLora(prefix="diffusion_model.", renames=LTX2_ORIGINAL_NAMES)
    # Gemma 3 and the connectors (which read the tokenizer's mask): both decide a cached caption
    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"), ("connectors", "tokenizer"),
    )  # fmt: skip

    def trains(self, parameter: str) -> bool:
        """The video stream's parameters: not the audio stream's nor those of the attention
        between the streams (`audio_*`, `av_cross_attn_*`, `video_to_audio_attn`, a block's
        `video_a2v_cross_attn_scale_shift_table`), which the isolated video stream never
        reaches (tests/test_ltx2.py: exactly the parameters without a gradient)."""
        frozen = ("audio_", "av_cross_attn_", "video_to_audio", "video_a2v_")
        return not any(part.startswith(frozen) for part in parameter.split("."))

    @torch.no_grad()
    def encode_latents(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        return ltx2_latents(vae, pixels)  # its VAE's statistics are buffers, not config

    def load_text(self, source: Path, *, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
        """Gemma 3 (the class model_index.json names), the connectors and the tokenizer."""
        from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

        gemma_only = replace(self, text_subfolders=self.text_subfolders[:1])
        (encoder,), (tokenizer,) = ModelFamily.load_text(gemma_only, source, dtype=dtype)
        connectors = LTX2TextConnectors.from_pretrained(source, subfolder="connectors",
                                                        torch_dtype=dtype)  # fmt: skip
        return [encoder, connectors], [tokenizer, tokenizer]

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """LTX2Pipeline's `_get_gemma_prompt_embeds`, then its connectors' video output."""
        from zerotuner.families.flux2 import execution_device  # streamed encoders' too

        (gemma, connectors), (tokenizer, _) = encoders, tokenizers
        tokenizer.padding_side = "left"  # as the pipeline sets it: Gemma's chat-style padding
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokens = tokenizer(
            [caption.strip() for caption in captions], padding="max_length",
            max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
            return_tensors="pt",
        ).to(execution_device(gemma))  # fmt: skip
        out = gemma(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                    output_hidden_states=True)  # fmt: skip
        states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)
        device = execution_device(connectors)
        video, _, mask = connectors(
            states.to(device, connectors.dtype), tokens.attention_mask.to(device),
            padding_side="left",
        )  # fmt: skip
        return {"prompt_embeds": video, "prompt_attention_mask": mask}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "encoder_attention_mask": batch["prompt_attention_mask"].to(dtype),
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> LTX2Objective:
        c = model_config
        patch = (int(c.get("patch_size_t", 1)), int(c.get("patch_size", 1)))
        text = c.get("caption_channels", 3840) if c.get("use_prompt_embeddings", True) else (
            c.get("audio_cross_attention_dim", 2048))  # fmt: skip
        audio = (int(c.get("audio_in_channels", 128)), int(text))
        return LTX2Objective(self.flow_config(settings, scheduler), patch=patch, audio=audio)

    def frame_step(self, source: Any) -> int:
        """Clips of step * k + 1 frames: the VAE's temporal compression (LTX-2's 8x)."""
        from zerotuner.families.shapes import video_scales

        return video_scales(Path(source))[0]

    def latent_multiple(self, model_config: Any) -> int:
        return int(model_config.patch_size)
