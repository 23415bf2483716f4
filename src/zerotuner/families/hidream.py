"""HiDream-I1 (HiDream-ai/HiDream-I1-Full, -Dev, -Fast): a 17.1B sparse diffusion transformer
(HiDreamImageTransformer2DModel: 16 double-stream and 32 single-stream blocks, each with a
mixture-of-experts SwiGLU of 4 routed experts, 2 active per token, and a shared one) on FLUX.1's
16-channel VAE, conditioned by four text encoders: CLIP-L and CLIP-G (pooled, side by side),
T5-XXL and Llama-3.1-8B-Instruct, whose every layer's states a caption carries (each block reads
its own Llama layer, `llama_layers`).

Full is the undistilled base; Dev and Fast are its distilled (28- and 16-step) checkpoints, the
same network. Adapters are trained on Full and applied on Dev or Fast (diffusers' HiDream LoRA
example trains on Full; the model card: Dev and Fast are distilled from it); a Dev or Fast model
is the same family here and trains, with a warning that says so (detection.distilled_note).

The objective is diffusers' DreamBooth LoRA example's (huggingface/diffusers at 58eb52c,
examples/dreambooth/train_dreambooth_lora_hidream.py) in what HiDreamImagePipeline samples with
(diffusers 0.42, pipelines/hidream_image/):
- captions: the pipeline's own `encode_prompt` (CLIP-L's and CLIP-G's pooled projections side
  by side, at min(max_sequence_length, 218) tokens; T5's last states; Llama's states after each
  of its layers, `hidden_states[1:]`, at max_sequence_length tokens, 128 by default), cached
  padded: 32 Llama layers and T5, 33 x 4096 values per token (33 MiB a caption at 128 tokens);
- latents `(x - shift_factor) * scaling_factor`, noised at sigmas from the density the settings
  name, shifted by 3.0 whatever the scheduler's config says (the example loads its scheduler
  with `shift=3.0`), the timestep on the 0-1000 scale (`timesteps`), the transformer's output
  negated (the pipeline's and the example's `model_pred * -1`) and `noise - x` regressed.

The example loads the transformer with `force_inference_output=True`, whose mixture of experts
then runs its inference path, under `torch.no_grad`: the routed experts get no gradient (its
adapters sit on the attention alone). Full fine-tuning trains them, so the model keeps its
published config: in training mode the experts run their differentiable path and the output
comes in patches (batch, channels, tokens, patch^2), put back into the latents' layout here
(`from_patches`). Neither path adds the router's auxiliary balance loss (`MoEGate` computes it in
training mode; `MOEFeedForwardSwiGLU` drops it, its `AddAuxiliaryLoss` commented out), and the
example trains without it: so does this family.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from zerotuner.families.base import ComfyLora
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective

if TYPE_CHECKING:
    from zerotuner.settings.schema import Settings

SHIFT = 3.0  # the example's scheduler shift (FlowMatchEulerDiscreteScheduler(..., shift=3.0))


def from_patches(patches: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """The transformer's training-mode output (batch, channels, tokens, patch * patch; tokens
    padded to its max_seq for a non-square image) as (batch, channels, height, width): the
    layout its inference-mode `unpatchify` gives."""
    batch, channels = patches.shape[:2]
    rows, columns = height // patch, width // patch
    cells = patches[:, :, : rows * columns].reshape(batch, channels, rows, columns, patch, patch)
    return cells.permute(0, 1, 2, 4, 3, 5).reshape(batch, channels, height, width)


@dataclass(frozen=True)
class HiDreamObjective(FlowObjective):
    """Flow matching on unpacked latents (the transformer patches them itself) with the
    transformer's prediction negated."""

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        out = model(hidden_states=latents, timesteps=t, **kwargs).sample
        inner = getattr(model, "module", model)  # the DeepSpeed engine's transformer
        if inner.training and not inner.config.force_inference_output:
            height, width = latents.shape[-2:]
            out = from_patches(out, height, width, int(inner.config.patch_size))
        return -out


@dataclass(frozen=True)
class HiDream(FlowFamily):
    # ComfyUI's HiDream has the original checkpoint's names, which diffusers' are: the file is
    # `diffusion_model.<module>`, as diffusers' `_convert_non_diffusers_hidream_lora_to_diffusers`
    # (loaders/lora_conversion_utils.py, diffusers 0.42) reads it back
    comfy_lora: ComfyLora = ComfyLora(prefix="diffusion_model.")
    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"),
        ("text_encoder_2", "tokenizer_2"),
        ("text_encoder_3", "tokenizer_3"),
        ("text_encoder_4", "tokenizer_4"),
    )

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """HiDreamImagePipeline.encode_prompt (no negative prompt): T5's states, Llama's per
        layer (batch first here: the pipeline puts the layers first) and the pooled CLIPs."""
        from diffusers import HiDreamImagePipeline

        from zerotuner.families.flux2 import execution_device

        (clip_l, clip_g, t5, llama), (tok_l, tok_g, tok_t5, tok_llama) = encoders, tokenizers
        text_only = HiDreamImagePipeline(
            scheduler=None, vae=None, text_encoder=clip_l, tokenizer=tok_l,
            text_encoder_2=clip_g, tokenizer_2=tok_g, text_encoder_3=t5, tokenizer_3=tok_t5,
            text_encoder_4=llama, tokenizer_4=tok_llama, transformer=None,
        )  # fmt: skip
        t5_states, _, llama_states, _, pooled, _ = text_only.encode_prompt(
            list(captions), device=execution_device(llama), do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return {
            "prompt_embeds": t5_states,
            "llama_embeds": llama_states.transpose(0, 1),
            "pooled_prompt_embeds": pooled,
        }

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states_t5": batch["prompt_embeds"].to(dtype),
            "encoder_hidden_states_llama3": batch["llama_embeds"].to(dtype).transpose(0, 1),
            "pooled_embeds": batch["pooled_prompt_embeds"].to(dtype),
        }

    def objective(self, settings: Settings, scheduler: Any, model_config: Any) -> Any:
        config = replace(self.flow_config(settings, scheduler), shift=SHIFT)
        return HiDreamObjective(config)
