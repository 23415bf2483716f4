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

from zerotuner.families import REGISTRY
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective, image_ids, pack, unpack


@dataclass(frozen=True)
class ChromaObjective(FlowObjective):
    """Flux's packed flow matching without guidance or pooled text, with Chroma's mask."""

    packed: bool = True

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
        batch, (height, width) = noisy.shape[0], noisy.shape[-2:]
        states, text_mask = kwargs["encoder_hidden_states"], kwargs["text_mask"]
        image_tokens = (height // 2) * (width // 2)
        mask = torch.cat(
            [text_mask.to(device, dtype), torch.ones(batch, image_tokens, device=device,
                                                     dtype=dtype)], dim=1,
        )  # fmt: skip
        pred = model(
            hidden_states=pack(noisy).to(device, dtype), encoder_hidden_states=states,
            timestep=sigmas.to(device, dtype), img_ids=image_ids(height, width).to(device),
            txt_ids=torch.zeros(states.shape[1], 3, device=device), attention_mask=mask,
        ).sample  # fmt: skip
        return unpack(pred, height, width)


@dataclass(frozen=True)
class Chroma(FlowFamily):
    text_subfolders: tuple[tuple[str, str], ...] = (("text_encoder", "tokenizer"),)
    max_sequence_length: int = REGISTRY["chroma"].t5_tokens
    packed: bool = True

    def denoiser_class(self) -> type:
        from diffusers import ChromaTransformer2DModel

        return ChromaTransformer2DModel

    def pipeline_class(self) -> type:
        from diffusers import ChromaPipeline

        return ChromaPipeline

    @torch.no_grad()
    def encode_text(self, components: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """ChromaPipeline._get_t5_prompt_embeds: the masked T5 states and the text mask."""
        (encoder,), (tokenizer,) = components.text_encoders, components.tokenizers
        tokens = tokenizer(
            captions, padding="max_length", max_length=self.max_sequence_length,
            truncation=True, return_tensors="pt",
        )  # fmt: skip
        ids, mask = tokens.input_ids.to(encoder.device), tokens.attention_mask.to(encoder.device)
        states = encoder(ids, attention_mask=mask)[0]
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        text_mask = (positions <= mask.sum(dim=1, keepdim=True)).to(states.dtype)
        return {
            "prompt_embeds": states.to(self.cache_dtype).cpu(),
            "text_mask": text_mask.to(self.cache_dtype).cpu(),
        }

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "text_mask": batch["text_mask"].to(dtype),
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return ChromaObjective(self.flow_config(settings, scheduler))

    def latent_multiple(self, model_config: Any) -> int:
        return 2  # 2x2 packing
