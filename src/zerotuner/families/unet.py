"""The UNet families: SD 1.x and 2.x (one CLIP text encoder; SD 2.x's v-prediction comes from
its scheduler, not from the family) and SDXL (two encoders, pooled embeddings and size/crop
micro-conditioning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.base import ModelFamily, TokenIds


@dataclass(frozen=True)
class StableDiffusion(ModelFamily):
    """SD 1.x / 2.x: the base interface as it is."""


@dataclass(frozen=True)
class SDXL(ModelFamily):
    """Two encoders' penultimate states side by side, the second's pooled projection, and the
    micro-conditioning time ids (original size, crop top-left, target size) per image."""

    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"),
        ("text_encoder_2", "tokenizer_2"),
    )

    def pipeline_class(self) -> type:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def embed(self, encoders: list[Any], ids: TokenIds) -> dict[str, torch.Tensor]:
        outputs = [
            encoder(encoder_ids, output_hidden_states=True)
            for encoder, encoder_ids in zip(encoders, ids, strict=True)
        ]
        return {
            "prompt_embeds": torch.cat([out.hidden_states[-2] for out in outputs], dim=-1),
            "pooled_prompt_embeds": outputs[-1].text_embeds,
        }

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "added_cond_kwargs": {
                "text_embeds": batch["pooled_prompt_embeds"].to(dtype),
                "time_ids": batch["time_ids"].to(dtype),
            },
        }


def time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's micro-conditioning vector (height, width pairs), as the SDXL pipeline builds it."""
    return torch.tensor([*original_size, *crop_top_left, *target_size], dtype=torch.float32)
