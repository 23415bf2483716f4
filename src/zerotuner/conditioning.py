"""How each model family turns captions and image geometry into UNet inputs.

Everything that distinguishes SDXL from SD 1.x/2.x (two text encoders, pooled embeddings,
size/crop micro-conditioning) lives in a `Conditioning` per family, so the training loop has no
family flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zerotuner.model import Components


class Conditioning:
    """How one family turns captions and image geometry into UNet inputs.

    `encode_text` runs once per caption at caching time and returns per-example tensors;
    `embed` is the same computation with gradients (text encoders that train, see
    lora_text.py); `unet_kwargs` builds the keyword arguments of the UNet's forward from a
    batch that holds the embeddings.
    """

    text_subfolders: tuple[tuple[str, str], ...] = (("text_encoder", "tokenizer"),)

    def load_text(self, source: Path, *, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

        encoders, tokenizers = [], []
        for encoder_dir, tokenizer_dir in self.text_subfolders:
            cls = CLIPTextModelWithProjection if encoder_dir.endswith("_2") else CLIPTextModel
            encoders.append(cls.from_pretrained(source, subfolder=encoder_dir, dtype=dtype))
            tokenizers.append(AutoTokenizer.from_pretrained(source, subfolder=tokenizer_dir))
        return encoders, tokenizers

    @staticmethod
    def tokens(tokenizers: list[Any], captions: list[str]) -> torch.Tensor:
        """Token ids of every encoder, stacked: (encoders, captions, max length) on the CPU."""
        return torch.stack(
            [
                tokenizer(
                    captions,
                    padding="max_length",
                    max_length=tokenizer.model_max_length,
                    truncation=True,
                    return_tensors="pt",
                ).input_ids
                for tokenizer in tokenizers
            ]
        )

    def embed(self, encoders: list[Any], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """SD 1.x/2.x: the text encoder's last hidden state."""
        (encoder,) = encoders
        return {"prompt_embeds": encoder(ids[0]).last_hidden_state}

    @torch.no_grad()
    def encode_text(self, components: Components, captions: list[str]) -> dict[str, torch.Tensor]:
        encoders = components.text_encoders
        ids = self.tokens(components.tokenizers, captions).to(encoders[0].device)
        return {k: v.float().cpu() for k, v in self.embed(encoders, ids).items()}

    def unet_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}


class SDXLConditioning(Conditioning):
    """Two encoders' penultimate states side by side, the second's pooled projection, and the
    micro-conditioning time ids (original size, crop top-left, target size) per image."""

    text_subfolders = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))

    def embed(self, encoders: list[Any], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        states, pooled = [], None
        for encoder, encoder_ids in zip(encoders, ids, strict=True):
            out = encoder(encoder_ids, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)
        return {"prompt_embeds": torch.cat(states, dim=-1), "pooled_prompt_embeds": pooled}

    def unet_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "added_cond_kwargs": {
                "text_embeds": batch["pooled_prompt_embeds"].to(dtype),
                "time_ids": batch["time_ids"].to(dtype),
            },
        }


CONDITIONING: dict[str, Conditioning] = {
    "sdxl": SDXLConditioning(),
    "sd1": Conditioning(),
    "sd2": Conditioning(),  # v-prediction comes from the scheduler, not from the family
}


def time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's micro-conditioning vector (height, width pairs), as the SDXL pipeline builds it."""
    return torch.tensor([*original_size, *crop_top_left, *target_size], dtype=torch.float32)
