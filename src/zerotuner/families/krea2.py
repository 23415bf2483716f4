"""Krea 2 (krea/Krea-2-Raw, krea/Krea-2-Turbo): a 12.8B single-stream MMDiT
(Krea2Transformer2DModel: a text-fusion stage that folds 12 tapped Qwen3-VL-4B layers into one
stream, then 28 joint blocks) with Qwen-Image's VAE (AutoencoderKLQwenImage: latents normalised
by its per-channel mean and std) and a flow-matching scheduler with a resolution-aware shift.

Raw is the undistilled base, Turbo its 8-step distilled (TDM) checkpoint: the same network,
Turbo's model_index.json saying `is_distilled: true`. Adapters are trained on Raw and applied on
Turbo (Krea's release, the model cards, musubi-tuner's docs/krea2.md); a Turbo model is the
same family here and trains, with a warning that says so (detection.distilled_note).

diffusers has no Krea 2 training example and Krea's repository (krea-ai/krea-2) only samples, so
the objective is musubi-tuner's Krea 2 trainer's (kohya-ss/musubi-tuner at 30c658c,
src/musubi_tuner/krea2_train_network.py, `call_dit`, and training/trainer_base.py,
`krea2_shift`) in what Krea2Pipeline samples with (diffusers 0.42, pipelines/krea2/):
- captions: the pipeline's own `get_text_hidden_states` (Qwen-Image's template, the prompt
  padded to max_sequence_length *before* the assistant suffix, positions counting real tokens
  only, the states of `text_encoder_select_layers` stacked per token, the template's first 34
  tokens dropped) with its boolean mask, cached padded;
- latents `(x - latents_mean) / latents_std`, noised at sigmas from the density the settings
  name, shifted per image as the Raw pipeline shifts its schedule at that size
  (`exp(mu) sigma / (1 + (exp(mu) - 1) sigma)`, mu from 0.5 at 256 image tokens to 1.15 at 6400,
  the scheduler's base/max shift and sequence lengths; Turbo's fixed mu 1.15), packed 2x2
  (Krea2Pipeline._pack_latents is FluxPipeline's) with (0, row, column) position ids after the
  text's zeros, the timestep given as sigma (`t / 1000`), the text mask as the attention mask,
  and the velocity `noise - x` regressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from zerotuner.families.base import ComfyLora
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective, sample_sigmas

if TYPE_CHECKING:
    from zerotuner.settings.schema import Settings

# Krea2Pipeline's defaults: Qwen3-VL-4B's layers whose states it stacks, the Turbo checkpoint's mu
SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DISTILLED_MU = 1.15


def position_ids(text_tokens: int, height: int, width: int) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids for `height` x `width` latent cells (2x2 patches)."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.prepare_position_ids(text_tokens, height // 2, width // 2, "cpu")


@dataclass(frozen=True)
class Krea2Objective(FlowObjective):
    """Flux's 2x2 packing with Krea 2's position ids and text mask, sigmas shifted by each
    image's size (`mu`) as the pipeline's schedule is."""

    packed: bool = True
    # the scheduler's resolution-aware shift: (base_image_seq_len, max_image_seq_len,
    # base_shift, max_shift); `fixed_mu`: Turbo's
    shift_line: tuple[float, float, float, float] = (256, 6400, 0.5, 1.15)
    fixed_mu: float | None = None

    def mu(self, height: int, width: int) -> float:
        """The pipeline's `calculate_shift` for `height` x `width` latent cells."""
        if self.fixed_mu is not None:
            return self.fixed_mu
        low_len, high_len, low, high = self.shift_line
        slope = (high - low) / (high_len - low_len)
        return (height // 2) * (width // 2) * slope + low - slope * low_len

    def sigmas(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Flow matching's sigmas, with the static shift this batch's size gives."""
        height, width = latents.shape[-2:]
        config = replace(self.config, shift=math.exp(self.mu(height, width)))
        return sample_sigmas(latents.shape[0], config, generator)

    def describe(self) -> str:
        base = super().describe()
        if self.fixed_mu is not None:
            shift = f"shift exp({self.fixed_mu:g}), Turbo's"
        else:
            low_len, high_len, low, high = self.shift_line
            shift = f"shift exp(mu), mu {low:g}-{high:g} over {low_len:g}-{high_len:g} tokens"
        return base.replace(f"shift {self.config.shift:g}", shift)

    def packed_inputs(
        self, kwargs: dict[str, Any], batch: int, height: int, width: int
    ) -> dict[str, Any]:
        text_tokens = kwargs["encoder_hidden_states"].shape[1]
        return {**kwargs, "position_ids": position_ids(text_tokens, height, width)}


# Krea 2's diffusers module names to the original checkpoint's (krea-ai/krea-2 mmdit.py), which
# ComfyUI's Krea 2 model has: the inverse of diffusers' `_convert_non_diffusers_krea2_lora_to_
# diffusers` (loaders/lora_conversion_utils.py, diffusers 0.42), for the layers LoRA wraps
KREA2_ORIGINAL_NAMES = (
    ("transformer_blocks", "blocks"), ("text_fusion", "txtfusion"),
    ("attn.to_q", "attn.wq"), ("attn.to_k", "attn.wk"), ("attn.to_v", "attn.wv"),
    ("attn.to_out.0", "attn.wo"), ("attn.to_gate", "attn.gate"),
    ("ff.gate", "mlp.gate"), ("ff.up", "mlp.up"), ("ff.down", "mlp.down"),
    ("img_in", "first"), ("final_layer.linear", "last.linear"),
    ("time_embed.linear_1", "tmlp.0"), ("time_embed.linear_2", "tmlp.2"),
    ("time_mod_proj", "tproj.1"), ("txt_in.linear_1", "txtmlp.1"),
    ("txt_in.linear_2", "txtmlp.3"),
)  # fmt: skip


@dataclass(frozen=True)
class Krea2(FlowFamily):
    packed: bool = True
    comfy_lora: ComfyLora = ComfyLora(prefix="diffusion_model.", renames=KREA2_ORIGINAL_NAMES)
    select_layers: tuple[int, ...] = SELECT_LAYERS  # the pipeline's text_encoder_select_layers
    distilled: bool = False  # Turbo: model_index.json's is_distilled

    def configured(self, settings: Settings, source: Path | None = None) -> Self:
        """The run's caption length, and the pipeline's tapped layers and distillation read
        from its model_index.json at `source`."""
        family = super().configured(settings, source)
        index = Path(source) / "model_index.json" if source is not None else None
        if index is None or not index.is_file():
            return family
        from zerotuner.families.stored import model_json

        config = model_json(index)
        layers = config.get("text_encoder_select_layers") or SELECT_LAYERS
        return replace(family, select_layers=tuple(int(i) for i in layers),
                       distilled=bool(config.get("is_distilled")))  # fmt: skip

    def text_cache_tag(self) -> str:  # other taps are other cached states
        return f"{super().text_cache_tag()}:layers-{'-'.join(map(str, self.select_layers))}"

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """Krea2Pipeline.get_text_hidden_states: the tapped layers' states and the mask."""
        from diffusers import Krea2Pipeline

        from zerotuner.families.flux2 import execution_device

        (encoder,), (tokenizer,) = encoders, tokenizers
        text_only = Krea2Pipeline(
            scheduler=None, vae=None, text_encoder=encoder, tokenizer=tokenizer,
            transformer=None, text_encoder_select_layers=self.select_layers,
        )  # fmt: skip
        states, mask = text_only.get_text_hidden_states(
            list(captions), self.max_sequence_length, execution_device(encoder)
        )
        return {"prompt_embeds": states, "text_mask": mask}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "encoder_attention_mask": batch["text_mask"].bool(),
        }

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        config = scheduler.config
        line = (
            float(config.get("base_image_seq_len", 256)),
            float(config.get("max_image_seq_len", 6400)),
            float(config.get("base_shift", 0.5)),
            float(config.get("max_shift", 1.15)),
        )
        fixed = DISTILLED_MU if self.distilled else None
        return Krea2Objective(self.flow_config(settings, scheduler), shift_line=line,
                              fixed_mu=fixed)  # fmt: skip
