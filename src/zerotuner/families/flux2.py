"""FLUX.2 (black-forest-labs/FLUX.2-dev, FLUX.2-klein-4B / -9B): Flux2Transformer2DModel, a
Flux-style transformer with modulation shared across its blocks and 4-axis rotary positions,
on 2x2 patches of a 32-channel VAE (AutoencoderKLFlux2) normalised per patch channel by the
VAE's batch-norm statistics. [dev] (32B) is conditioned on Mistral Small 3.x (a 24B
Mistral3ForConditionalGeneration) and has a guidance embedding; [klein] (4B, 9B) on Qwen3
(4B, 8B) and has none.

The objective is diffusers' FLUX.2 LoRA examples' (examples/dreambooth/
train_dreambooth_lora_flux2.py and train_dreambooth_lora_flux2_klein.py, diffusers main
58eb52c) and what Flux2Pipeline / Flux2KleinPipeline sample with (diffusers 0.42,
pipelines/flux2/):
- captions: the pipeline's own static encoder (`_get_mistral_3_small_prompt_embeds`: the
  system message and the prompt in Mistral's chat template; `_get_qwen3_prompt_embeds`: the
  prompt in Qwen3's, thinking off), padded to max_sequence_length, the hidden states of
  layers (10, 20, 30) ([dev]) or (9, 18, 27) ([klein]) side by side; no text mask (the
  transformer attends to the padding, as the pipelines do);
- latents: the VAE's mode, cut in 2x2 patches (`_patchify_latents`) and normalised by
  `vae.bn`'s running mean and std (`flux2_latents` below, which `Flux2.encode_latents`
  calls), cached back in the VAE's grid: noise and the squared error do not see
  the permutation;
- sigmas from the density the settings name, unshifted (the scheduler shifts dynamically), the
  noised patches packed into a sequence (`_pack_latents`) with (t, h, w, l) ids
  (`_prepare_latent_ids`) and text ids (`_prepare_text_ids`), the timestep as sigma
  (`timesteps / 1000`), guidance only where the transformer embeds it (the klein example:
  `if transformer.config.guidance_embeds`), and the velocity `noise - x` regressed.
FLUX.2 with reference images (image editing, the `*_img2img.py` examples) is refused
(families.refuse_edit_model).

Caching FLUX.2 [dev]'s text encoder: its 24B parameters are ~48 GB in bf16, more than a 24 or
40 GB GPU holds, and on an 80 GB one they would sit beside a ZeRO-3 partition. On a GPU,
`train.model.load_frozen` keeps it in host memory and streams it to the device layer by layer
as it encodes (accelerate's `cpu_offload`, as diffusers' `enable_sequential_cpu_offload`; the
examples' `--offload` moves it whole, `--remote_text_encoder` encodes on the hub), a one-time
cost per cached caption; the planner's caching phase counts it whole in host memory and its
largest layer on the device (Spec.text_stream_params). Quantizing it instead would change the
cached states away from the pipeline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective


def latent_ids(batch: int, height: int, width: int) -> torch.Tensor:
    """(t, h, w, l) ids of the 2x2 patches of `height` x `width` latent cells."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_latent_ids(torch.empty(batch, 1, height // 2, width // 2))


@dataclass(frozen=True)
class Flux2Objective(FlowObjective):
    """Flux's flow matching on FLUX.2's patches: 4-axis ids, the text's own ids."""

    packed: bool = True

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2Pipeline

        return Flux2Pipeline._pack_latents(Flux2Pipeline._patchify_latents(latents))

    def unpack(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        from diffusers import Flux2Pipeline

        ids = latent_ids(packed.shape[0], height, width).to(packed.device)
        return Flux2Pipeline._unpatchify_latents(
            Flux2Pipeline._unpack_latents_with_ids(packed, ids)
        )

    def packed_inputs(
        self, kwargs: dict[str, Any], batch: int, height: int, width: int
    ) -> dict[str, Any]:
        from diffusers import Flux2Pipeline

        states = kwargs["encoder_hidden_states"]
        extra = {"img_ids": latent_ids(batch, height, width),
                 "txt_ids": Flux2Pipeline._prepare_text_ids(states.cpu())}  # fmt: skip
        if self.guidance is not None:
            extra["guidance"] = torch.full((batch,), self.guidance)
        return {**extra, **kwargs}


def execution_device(module: Any) -> torch.device:
    """Where a (possibly streamed: accelerate hooks) encoder runs."""
    from diffusers.utils.torch_utils import get_module_execution_device

    return torch.device(get_module_execution_device(module))


@dataclass(frozen=True)
class Flux2(FlowFamily):
    """FLUX.2 [dev]: Mistral Small 3.x's states of layers 10, 20 and 30."""

    packed: bool = True
    # the pipeline's static caption encoder (its default layers are the family's)
    prompt_encoder: tuple[str, str] = ("Flux2Pipeline", "_get_mistral_3_small_prompt_embeds")

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """The pipeline's own encoder, padded to the max sequence length."""
        import diffusers

        (encoder,), (tokenizer,) = encoders, tokenizers
        pipeline, method = self.prompt_encoder
        states = getattr(getattr(diffusers, pipeline), method)(
            encoder, tokenizer, list(captions), device=execution_device(encoder),
            max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return {"prompt_embeds": states}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}

    @torch.no_grad()
    def encode_latents(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        """The distribution's mode, normalised by the VAE's batch norm (`flux2_latents`)."""
        return flux2_latents(vae, vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        guidance = settings.train_guidance if model_config.get("guidance_embeds") else None
        return Flux2Objective(self.flow_config(settings, scheduler), guidance=guidance)


@dataclass(frozen=True)
class Flux2Klein(Flux2):
    """FLUX.2 [klein]: Qwen3's states of layers 9, 18 and 27, no guidance embedding."""

    prompt_encoder: tuple[str, str] = ("Flux2KleinPipeline", "_get_qwen3_prompt_embeds")


def flux2_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """FLUX.2's training latents (train_dreambooth_lora_flux2.py): 2x2 patches normalised by
    the VAE's batch-norm running mean and std, put back in the VAE's grid (the objective
    patches them again: flow matching's noise and loss do not see the permutation)."""
    from diffusers import Flux2Pipeline

    patches = Flux2Pipeline._patchify_latents(latents.float())
    view = (1, -1, 1, 1)
    mean = vae.bn.running_mean.view(view).float()
    std = torch.sqrt(vae.bn.running_var.view(view).float() + vae.config.batch_norm_eps)
    return Flux2Pipeline._unpatchify_latents((patches - mean) / std).cpu()
