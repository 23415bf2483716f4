"""Chroma (lodestones/Chroma1-HD): FLUX.1 [schnell]'s transformer with its 3.3B-parameter
modulation replaced by a small approximator network, no CLIP (T5-XXL alone) and no guidance
embedding (the model card; diffusers' ChromaTransformer2DModel).

What it trains on is what ChromaPipeline samples with (diffusers 0.42,
pipelines/chroma/pipeline_chroma.py; diffusers has no Chroma training example, so the rest is
its Flux example's, train_dreambooth_lora_flux.py):
- captions: T5's last states computed *with* the tokenizer's attention mask (`_get_t5_prompt_
  embeds`: "unlike FLUX, Chroma uses the attention mask"), and a text mask that keeps every
  real token and the first padding one (`mask_indices <= seq_lengths`), cached beside them;
- the transformer's attention mask: that text mask followed by ones for every image token
  (`_prepare_attention_mask`);
- latents packed in 2x2 patches with (0, row, column) ids and zero text ids, as Flux's, and the
  timestep given as sigma itself (the pipeline passes `t / 1000`); the scheduler shifts its
  sigmas dynamically, so training samples them unshifted, as for Flux.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective


@dataclass(frozen=True)
class ChromaObjective(FlowObjective):
    """Flux's packed flow matching without guidance or pooled text, with Chroma's mask."""

    packed: bool = True

    def packed_inputs(
        self, kwargs: dict[str, Any], batch: int, height: int, width: int
    ) -> dict[str, Any]:
        """Flux's, and the attention mask: the text mask, then ones for the image's tokens."""
        text_mask = kwargs["text_mask"]
        image = torch.ones(batch, (height // 2) * (width // 2), dtype=text_mask.dtype)
        mask = torch.cat([text_mask, image.to(text_mask.device)], dim=1)
        states = {k: v for k, v in kwargs.items() if k != "text_mask"}
        return {**super().packed_inputs(states, batch, height, width), "attention_mask": mask}


@dataclass(frozen=True)
class Chroma(FlowFamily):
    packed: bool = True

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """ChromaPipeline._get_t5_prompt_embeds: the masked T5 states and the text mask."""
        (encoder,), (tokenizer,) = encoders, tokenizers
        tokens = self.padded_tokens(tokenizer, captions, encoder.device)
        states = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0]
        mask = tokens.attention_mask
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        text_mask = (positions <= mask.sum(dim=1, keepdim=True)).to(states.dtype)
        return {"prompt_embeds": states, "text_mask": text_mask}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "text_mask": batch["text_mask"].to(dtype),
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return ChromaObjective(self.flow_config(settings, scheduler))
