"""Z-Image (Tongyi-MAI/Z-Image, Z-Image-Turbo): a single-stream DiT of about 6B parameters
(ZImageTransformer2DModel: noise and context refiners, then 30 joint layers) conditioned on
Qwen3-4B's states, with FLUX.1's 16-channel VAE and a flow-matching scheduler with a static
shift (3.0).

The objective is diffusers' Z-Image LoRA example's (examples/dreambooth/
train_dreambooth_lora_z_image.py, diffusers 0.42) and what ZImagePipeline samples with
(pipelines/z_image/pipeline_z_image.py):
- captions: each prompt put in Qwen3's chat template (`apply_chat_template(...,
  add_generation_prompt=True, enable_thinking=True)`), tokenized to max_sequence_length with
  its attention mask, and Qwen3's second-to-last hidden states of the real tokens only
  (`hidden_states[-2]`, `prompt_embeds[i][prompt_masks[i]]`); cached padded with the mask
  beside them, and cut back to one tensor per caption for the transformer;
- sigmas from the density the settings name, shifted by the scheduler's static shift (the
  example indexes `noise_scheduler.timesteps`, which carry it), `(1 - sigma) x + sigma n`;
- the transformer takes lists (one (channels, 1, height, width) latent per image, one
  caption's states each) and the timestep `(1000 - t) / 1000 = 1 - sigma`, and predicts
  `x - n`: the example negates its output (`model_pred = -model_pred`) against the target
  `noise - x`, as the pipeline negates it before the scheduler's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective


@dataclass(frozen=True)
class ZImageObjective(FlowObjective):
    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        return 1 - sigmas  # the pipeline's (1000 - t) / 1000

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """One (channels, 1, height, width) latent per image in a list; the output negated."""
        out = model(list(latents.unsqueeze(2).unbind(dim=0)), t, kwargs["cap_feats"],
                    return_dict=False)[0]  # fmt: skip
        return -torch.stack(out, dim=0).squeeze(2)


@dataclass(frozen=True)
class ZImage(FlowFamily):
    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """ZImagePipeline._encode_prompt, padded: the states and the tokens' mask."""
        (encoder,), (tokenizer,) = encoders, tokenizers
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": caption}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for caption in captions
        ]
        tokens = self.padded_tokens(tokenizer, prompts, encoder.device)
        mask = tokens.attention_mask.bool()
        states = encoder(input_ids=tokens.input_ids, attention_mask=mask,
                         output_hidden_states=True)  # fmt: skip
        return {"prompt_embeds": states.hidden_states[-2], "text_mask": mask}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """One caption's states per image, its real tokens only (the pipeline's list)."""
        masks = batch["text_mask"].bool()
        return {
            "cap_feats": [
                states[mask].to(dtype)
                for states, mask in zip(batch["prompt_embeds"], masks, strict=True)
            ]
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return ZImageObjective(self.flow_config(settings, scheduler))

    def latent_multiple(self, model_config: Any) -> int:
        return int(model_config.all_patch_size[0])
