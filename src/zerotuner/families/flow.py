"""The flow-matching transformer families: SD3 / SD3.5 (MMDiT; CLIP-L and CLIP-G, projected
and pooled, plus T5-XXL) and Flux.1 (double- and single-stream blocks; CLIP-L pooled plus
T5-XXL, 2x2 latent packing, and a guidance embedding in the guidance-distilled checkpoints).

Their text conditioning is what each pipeline's own `encode_prompt` computes (the test holds
them equal), cached on disk in bf16: a T5 caption is max-sequence-length x 4096 values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F

from zerotuner.families.base import ComfyLora, ModelFamily, TokenIds
from zerotuner.families.registry import REGISTRY

if TYPE_CHECKING:
    from pathlib import Path

    from zerotuner.settings.schema import Settings


@dataclass(frozen=True)
class FlowFamily(ModelFamily):
    """A flow-matching transformer family: its transformer and pipeline are the classes its
    REGISTRY spec names, its captions are cut at `max_sequence_length` tokens (0: the spec's
    `t5_tokens`, the pipeline's default)."""

    denoiser: str = "transformer"
    cache_dtype: torch.dtype = torch.bfloat16
    # ComfyUI maps the diffusers names of SD3's, the Flux classes', Qwen-Image's and Z-Image's
    comfy_lora: ComfyLora = ComfyLora()
    max_sequence_length: int = 0  # tokens per caption of its long encoder (T5, Qwen...)
    packed: bool = False  # latents enter as 2x2 patches with position ids (Flux)

    def __post_init__(self) -> None:
        if not self.max_sequence_length:
            object.__setattr__(self, "max_sequence_length", REGISTRY[self.name].t5_tokens)

    def configured(self, settings: Settings, source: Path | None = None) -> Self:
        """The family with the run's T5 length (ZT_MAX_SEQUENCE_LENGTH, else its default)."""
        if settings.max_sequence_length is None:
            return self
        return replace(self, max_sequence_length=settings.max_sequence_length)

    def text_cache_tag(self) -> str:
        # another length is another cached tensor
        return f":{REGISTRY[self.name].long_encoder.lower()}-{self.max_sequence_length}"

    def denoiser_class(self) -> type:
        import diffusers

        return getattr(diffusers, REGISTRY[self.name].transformer)

    def pipeline_class(self) -> type:
        import diffusers

        return getattr(diffusers, REGISTRY[self.name].pipeline)

    def scheduler_class(self) -> type:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler

    def tokens(self, tokenizers: list[Any], captions: list[str]) -> list[torch.Tensor]:
        """CLIP's ids at 77 tokens, T5's (the last tokenizer) at the max sequence length."""
        *clips, t5 = tokenizers
        return [self.tokenize(t, captions) for t in clips] + [
            self.tokenize(t5, captions, self.max_sequence_length)
        ]

    def padded_tokens(self, tokenizer: Any, texts: list[str], device: Any) -> Any:
        """The tokenizer's ids and attention mask, padded to the max sequence length."""
        return tokenizer(
            texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
            return_tensors="pt",
        ).to(device)  # fmt: skip

    @torch.no_grad()
    def encode_text(self, components: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        encoders, tokenizers = components.text_encoders, components.tokenizers
        states = self.encode_captions(encoders, tokenizers, captions)
        return {k: v.to(self.cache_dtype).cpu() for k, v in states.items()}

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """What a caption is cached as (on the encoders' device): `embed` of its `tokens`, or
        what the family's pipeline's own prompt encoding computes."""
        ids = [i.to(encoders[0].device) for i in self.tokens(tokenizers, captions)]
        return self.embed(encoders, ids)

    def flow_config(self, settings: Settings, scheduler: Any) -> Any:
        """The sigma sampling the run's settings and the model's scheduler give."""
        from zerotuner.families.flow_matching import FlowConfig

        return FlowConfig.from_scheduler(
            scheduler.config, weighting=settings.weighting_scheme, logit_mean=settings.logit_mean,
            logit_std=settings.logit_std, mode_scale=settings.mode_scale,
            timestep_range=settings.timesteps,
        )  # fmt: skip

    def objective(self, settings: Settings, scheduler: Any, model_config: Any) -> Any:
        from zerotuner.families.flow_matching import FlowObjective

        guidance = settings.train_guidance if model_config.get("guidance_embeds") else None
        config = self.flow_config(settings, scheduler)
        return FlowObjective(config, packed=self.packed, guidance=guidance)

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """The long encoder's states and (SD3, Flux) the pooled CLIP vector."""
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "pooled_projections": batch["pooled_prompt_embeds"].to(dtype),
        }

    def pipeline_kwargs(self, settings: Settings) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def latent_multiple(self, model_config: Any) -> int:
        """2x2 packing, or the transformer's patch size."""
        return 2 if self.packed else int(model_config.patch_size)


@dataclass(frozen=True)
class SD3(FlowFamily):
    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"),
        ("text_encoder_2", "tokenizer_2"),
        ("text_encoder_3", "tokenizer_3"),
    )

    def embed(self, encoders: list[Any], ids: TokenIds) -> dict[str, torch.Tensor]:
        """Both CLIPs' penultimate states side by side, zero-padded to T5's width and put
        before T5's states along the tokens; their pooled projections side by side."""
        *clips, t5 = encoders
        states, pooled = [], []
        for encoder, encoder_ids in zip(clips, ids, strict=False):
            out = encoder(encoder_ids, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        t5_states = t5(ids[-1])[0]
        clip = torch.cat(states, dim=-1)
        clip = F.pad(clip, (0, t5_states.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip, t5_states], dim=-2),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),
        }


@dataclass(frozen=True)
class Flux(FlowFamily):
    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"),
        ("text_encoder_2", "tokenizer_2"),
    )
    packed: bool = True

    def embed(self, encoders: list[Any], ids: TokenIds) -> dict[str, torch.Tensor]:
        """T5's states, and CLIP-L's pooled output."""
        clip, t5 = encoders
        return {
            "prompt_embeds": t5(ids[1])[0],
            "pooled_prompt_embeds": clip(ids[0]).pooler_output,
        }
