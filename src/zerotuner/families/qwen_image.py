"""Qwen-Image (Qwen/Qwen-Image): a 20B MMDiT (QwenImageTransformer2DModel) conditioned on
Qwen2.5-VL-7B's last hidden states, with a video VAE (AutoencoderKLQwenImage: one-frame clips,
latents normalised by a per-channel mean and std) and a dynamically shifted flow-matching
scheduler.

The objective is diffusers' Qwen-Image LoRA example's (examples/dreambooth/
train_dreambooth_lora_qwen_image.py, diffusers 0.42) and what QwenImagePipeline samples with
(pipelines/qwenimage/pipeline_qwenimage.py):
- captions: each prompt put in the pipeline's `prompt_template_encode` (a system turn that asks
  for the image's description, then the user turn), Qwen2.5-VL's last hidden states of the real
  tokens with the template's first `prompt_template_encode_start_idx` (34) dropped, padded with
  a mask (`_get_qwen_prompt_embeds`; cached padded to max_sequence_length, trimmed per batch to
  its longest caption);
- latents `(x - latents_mean) / latents_std`, noised at unshifted sigmas (the scheduler shifts
  dynamically), packed 2x2 (`_pack_latents`, FluxPipeline's) with `img_shapes`
  [(1, h / 2, w / 2)] per image, the timestep given as sigma (`timesteps / 1000`), and the
  velocity `noise - x` regressed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)  # QwenImagePipeline.prompt_template_encode
TEMPLATE_TOKENS = (
    34  # its prompt_template_encode_start_idx: the template's tokens before the prompt
)


@dataclass(frozen=True)
class QwenImageObjective(FlowObjective):
    """Flux's 2x2 packing (QwenImagePipeline._pack_latents is FluxPipeline's), no position ids
    or guidance: the image's shape in patches instead."""

    packed: bool = True

    def packed_inputs(
        self, kwargs: dict[str, Any], batch: int, height: int, width: int
    ) -> dict[str, Any]:
        return {**kwargs, "img_shapes": [(1, height // 2, width // 2)] * batch}


@dataclass(frozen=True)
class QwenImage(FlowFamily):
    packed: bool = True

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """QwenImagePipeline._get_qwen_prompt_embeds, padded to the max sequence length."""
        (encoder,), (tokenizer,) = encoders, tokenizers
        tokens = tokenizer(
            [TEMPLATE.format(caption) for caption in captions],
            max_length=self.max_sequence_length + TEMPLATE_TOKENS, padding=True,
            truncation=True, return_tensors="pt",
        ).to(encoder.device)  # fmt: skip
        out = encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
            output_hidden_states=True,
        )  # fmt: skip
        states, mask = out.hidden_states[-1], tokens.attention_mask.bool()
        length = self.max_sequence_length
        embeds = states.new_zeros(len(captions), length, states.shape[-1])
        kept = torch.zeros(len(captions), length, dtype=self.cache_dtype)
        for i in range(len(captions)):
            real = states[i][mask[i]][TEMPLATE_TOKENS:][:length]
            embeds[i, : real.shape[0]] = real
            kept[i, : real.shape[0]] = 1
        return {"prompt_embeds": embeds, "text_mask": kept}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """The batch's states and mask, trimmed to its longest caption (the pipeline pads a
        batch of prompts to its longest)."""
        mask = batch["text_mask"]
        # counted in fp32: a bf16 sum rounds past 256 (Qwen-Image-Edit's 1369 vision tokens)
        longest = max(int(mask.float().sum(dim=1).max()), 1)
        return {
            "encoder_hidden_states": batch["prompt_embeds"][:, :longest].to(dtype),
            "encoder_hidden_states_mask": mask[:, :longest].to(torch.long),
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return QwenImageObjective(self.flow_config(settings, scheduler))
