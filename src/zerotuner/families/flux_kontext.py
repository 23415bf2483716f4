"""FLUX.1 Kontext [dev] (black-forest-labs/FLUX.1-Kontext-dev): FLUX.1 [dev]'s transformer
(FluxTransformer2DModel, the same config and text encoders, CLIP-L pooled and T5-XXL) trained to
edit: it sees a reference image's latents beside the noisy ones and makes the edited image the
caption asks for.

A family of its own rather than a flag on Flux.1: its pipeline (FluxKontextPipeline) is what
model_index.json names, its hub id says `Kontext`, its data are pairs (Spec.controls 1) and its
objective differs in one hook (`KontextObjective.predict`); everything else is Flux's (the
`Flux` subclass below). A bare transformer folder cannot tell the two apart (one class, one
config): it reads as Flux.1, and ZT_MODEL_FAMILY=fluxkontext names Kontext.

The objective is diffusers' Kontext LoRA example's (examples/dreambooth/
train_dreambooth_lora_flux_kontext.py, diffusers main 7f0942a) and what FluxKontextPipeline
samples with (diffusers 0.42, pipelines/flux/pipeline_flux_kontext.py):
- the reference (the control image) encoded by the VAE's mode, shifted and scaled as the
  target (`_encode_vae_image`), cropped, flipped and sized with its target (the example's
  dataset applies one transform to both; data/loading.py);
- both packed in 2x2 patches (`_pack_latents`); the reference's tokens follow the noisy ones
  along the sequence (`torch.cat([latents, image_latents], dim=1)`), with the same (0, row,
  column) ids but the first coordinate 1 (`image_ids[..., 0] = 1`);
- the transformer's output cut to the noisy tokens (`noise_pred[:, : latents.size(1)]`): the
  loss is on the target alone; the rest is Flux.1's flow matching (sigmas unshifted, the
  timestep as sigma, the guidance value its guidance-distilled checkpoint embeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.flow import Flux
from zerotuner.families.flow_matching import FlowObjective, image_ids


def reference_ids(height: int, width: int) -> torch.Tensor:
    """A reference's position ids: its own (row, column) grid, first coordinate 1."""
    ids = image_ids(height, width)
    ids[:, 0] = 1
    return ids


@dataclass(frozen=True)
class KontextObjective(FlowObjective):
    """Flux.1's packed flow matching with the reference latents (`control_latents`: batch,
    references, channels, height, width) packed after the noisy ones."""

    packed: bool = True

    def describe(self) -> str:
        return (
            f"{super().describe()}; the control image's latents packed beside the noisy "
            "ones as reference tokens (ids 1, row, column), the loss on the target's alone"
        )

    def reference_inputs(self, extra: dict[str, Any], references: torch.Size) -> dict[str, Any]:
        count, (height, width) = references[1], references[-2:]
        return {"img_ids": torch.cat([extra["img_ids"], *[reference_ids(height, width)] * count])}


@dataclass(frozen=True)
class FluxKontext(Flux):
    """FLUX.1 Kontext [dev]: Flux.1's conditioning, its control image's latents as reference."""

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {**super().model_kwargs(batch, dtype),
                "control_latents": batch["control_latents"].to(dtype)}  # fmt: skip

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        guidance = settings.train_guidance if model_config.get("guidance_embeds") else None
        return KontextObjective(self.flow_config(settings, scheduler), guidance=guidance)

    def pipeline_kwargs(self, settings: Any) -> dict[str, Any]:
        """Its pipeline sizes the output by area (`max_area`, 1024^2 unless told), whatever
        height and width say: the samples' area is the run's resolution squared."""
        area = {"max_area": settings.resolution**2} if settings.resolution else {}
        return {**super().pipeline_kwargs(settings), **area}
