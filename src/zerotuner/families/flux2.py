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

FLUX.2 is one checkpoint for text-to-image and editing: its pipelines take 0 to N reference
images (`image=`). A run whose data have control images (`foo.control.png`, then
`foo.control_1.png`, ...; metadata.jsonl's `control` columns; a dataset's `control_dir`:
data/controls.py) trains with them, each target with as many (Spec.controls: at most 6 for
[dev], 4 for [klein], as BFL's docs recommend; min_controls 0); a run whose data have none is
the text-to-image run above in every respect. The references train as the pipelines sample with
them (diffusers 0.42, pipelines/flux2/pipeline_flux2.py and pipeline_flux2_klein.py, `__call__`'s
"4. process images", `prepare_image_latents`, `_encode_vae_image`, `_prepare_image_ids`) and as
diffusers' img2img examples train (examples/dreambooth/train_dreambooth_lora_flux2_img2img.py
at diffusers 0392cd8, train_dreambooth_lora_flux2_klein_img2img.py at 027e8ee):
- each reference encoded by the VAE's mode and normalised by `vae.bn` as the target is
  (`flux2_latents`), cropped, flipped and sized with its target (data/loading.py; the pipeline
  resizes each to at most 1024^2 in area, sides multiples of 16: at ZT_RESOLUTION 1024 a bucket
  is that size, and the scan keeps only references of the target's aspect ratio);
- patched and packed as the target, the references' tokens after the noisy ones in order
  (`torch.cat([latents, image_latents], dim=1)`), reference i with (t, h, w, l) ids on its own
  grid at t = 10 + 10 i (`_prepare_image_ids`, scale 10), the same for every item of a batch
  (the examples' one reference: `_prepare_image_ids([cond_model_input[0:1]])` expanded);
- the transformer's output cut to the noisy tokens (`noise_pred[:, : latents.size(1)]`): the
  loss is on the target's alone. Samples of such a run edit an input image through the same
  pipeline (ZT_VALIDATION_IMAGES, else the data's first target's references).

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
    """Flux's flow matching on FLUX.2's patches: 4-axis ids, the text's own ids; a run's
    reference latents (`control_latents`) packed after the noisy ones, t = 10, 20, ..."""

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

    def reference_inputs(self, extra: dict[str, Any], references: torch.Size) -> dict[str, Any]:
        """The target's ids, then each reference's on its own grid at t = 10 + 10 i."""
        batch, count, (height, width) = references[0], references[1], references[-2:]
        ids = reference_ids(count, height, width).expand(batch, -1, -1)
        return {"img_ids": torch.cat([extra["img_ids"], ids], dim=1)}


def reference_ids(count: int, height: int, width: int) -> torch.Tensor:
    """(1, count x patches, 4) ids of `count` references of `height` x `width` latent cells,
    as Flux2Pipeline.prepare_image_latents gives them (`_prepare_image_ids`)."""
    from diffusers import Flux2Pipeline

    grids = [torch.empty(1, 1, height // 2, width // 2) for _ in range(count)]
    return Flux2Pipeline._prepare_image_ids(grids)


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
        """The caption's states, and a run with reference images their latents (batch,
        references, channels, height, width), packed after the noisy ones by the objective."""
        kwargs = {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}
        if "control_latents" in batch:
            kwargs["control_latents"] = batch["control_latents"].to(dtype)
        return kwargs

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
