"""HunyuanVideo 1.5 text-to-video (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v,
-720p_t2v; tencent/HunyuanVideo-1.5): an 8.3B dual-stream DiT (HunyuanVideo15Transformer3DModel:
54 blocks attending jointly to the clip's tokens and the text's) conditioned on Qwen2.5-VL-7B's
states (through its token refiner) and ByT5's states of the prompt's quoted text, with a causal
video VAE (AutoencoderKLHunyuanVideo15: 16 pixels and 4 frames per latent cell, 32 channels,
latents scaled by `scaling_factor`) and a flow-matching Euler scheduler.

What it trains on is what HunyuanVideo15Pipeline samples with (diffusers 0.42, pipelines/
hunyuan_video1_5/pipeline_hunyuan_video1_5.py), its own functions called for the captions:
- captions: `_get_mllm_prompt_embeds` (the prompt in its system-message chat template, Qwen
  tokens padded to 1000 + the template's 108, the third-to-last hidden state, the template's
  108 tokens cropped) with its mask, and `_get_byt5_prompt_embeds` (ByT5's states of the quoted
  text, 256 tokens; zeros and an empty mask for a prompt without quotes) with its mask, cached;
- latents `x * scaling_factor` (the pipeline decodes `latents / scaling_factor`), a clip (an
  image as one frame);
- the transformer takes the noised latents beside a zero condition latent and a zero mask
  channel (`prepare_cond_latents_and_mask`: text-to-video), zero image states for the 729
  vision tokens (which it masks out for text-to-video), and the timestep on the 0-1000 scale.

The noise schedule is the model's own trainer's (Tencent-Hunyuan/HunyuanVideo-1.5 at 995afc68,
train.py: `TimestepSampler` with its default `lognorm`, `timestep_transform` with
`train_timestep_shift` 3.0, `LinearInterpolationSchedule`, target `noise - latents`, MSE):
sigma = sigmoid(randn) (ZT_WEIGHTING_SCHEME's logit_normal(0, 1), the default), shifted as
`3 t / (1 + 2 t)` whatever the scheduler's inference shift, the input `(1 - t) x + t n`. Two
details differ, both too small to matter: the trainer keeps t inside [1e-5, 1 - 1e-5], and it
encodes with `latent_dist.sample()` where the cache here keeps the mean (deterministic, as for
every family). Its text-to-video task trains with `cond_latents` zero, as here; its
image-to-video task is HunyuanVideo15ImageToVideoPipeline's, the `hunyuanvideo15i2v` family
(hunyuan_video15_i2v.py).

A full fine-tuning leaves the image projection (`image_embedder`) frozen: text-to-video
multiplies its output by zero, so it gets no gradient and weight decay alone would move it.
HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42; `pipeline_class` is it with
diffusers' HunyuanVideo LoRA mixin (one `transformer` part, diffusers' peft names), which
writes the adapter and loads it with `load_lora_weights`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotuner.families.base import ComfyLora
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective

TRAIN_SHIFT = 3.0  # train.py's `train_timestep_shift` (the pipelines infer at 5 or 7)
VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens (SigLIP's, zero here)
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length: ByT5's


def hunyuan_video15_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """A clip (batch, channels, frames, h, w) or images (batch, channels, h, w) in [-1, 1] ->
    the latents HunyuanVideo15Pipeline decodes (`latents / scaling_factor`). One clip at a time:
    the VAE's mid-block attention mask broadcasts wrongly over a batch (diffusers 0.42)."""
    frames = pixels.ndim == 5
    clips = pixels.to(vae.device, vae.dtype)
    clips = clips if frames else clips[:, :, None]
    latents = torch.cat([vae.encode(clip[None]).latent_dist.mean.float().cpu() for clip in clips])
    latents = latents * float(vae.config.scaling_factor)
    return latents if frames else latents[:, :, 0]


@dataclass(frozen=True)
class HunyuanVideo15Objective(FlowObjective):
    """Flow matching on the clip as HunyuanVideo15Pipeline's transformer call takes it."""

    image_width: int = 1152  # the transformer's image_embed_dim: SigLIP's states

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        image = latents.ndim == 4  # (batch, channels, height, width): one frame
        clip = latents.unsqueeze(2) if image else latents
        batch, channels, *cells = clip.shape
        # text-to-video's condition: no first-frame latents, a zero mask channel, no image states
        condition = clip.new_zeros(batch, channels + 1, *cells)
        vision = clip.new_zeros(batch, VISION_TOKENS, self.image_width)
        out = model(hidden_states=torch.cat([clip, condition], dim=1), timestep=t,
                    image_embeds=vision, return_dict=False, **kwargs)[0]  # fmt: skip
        return out.squeeze(2) if image else out


REFINER = "context_embedder.token_refiner.refiner_blocks.*"  # its layers share the blocks' names
ORIGINAL_REFINER = "txt_in.individual_token_refiner.blocks.*"
# ComfyUI maps no diffusers names for HunyuanVideo, 1.0 or 1.5 (Comfy-Org/ComfyUI at 17358c8f,
# comfy/lora.py `model_lora_keys_unet`: its HunyuanVideo branch, which HunyuanVideo15
# subclasses, maps `transformer.` + the checkpoint's names, diffusion-pipe's LoRAs). Its model
# is Flux's double-stream blocks, loaded from checkpoints whose q, k and v are one weight
# (`img_attn_qkv`, `txt_attn_qkv`; the refiner's `self_attn_qkv`, Tencent's own too): diffusers'
# module names to those, for the layers LoRA wraps, are diffusers' scripts/
# convert_hunyuan_video1_5_to_diffusers.py read backwards (q, k, v stacked in that order).
# Not renamed, so not loaded by ComfyUI: the embedders and `norm_out` (its scale and shift
# swapped in the checkpoint).
ORIGINAL_NAMES = (
    *((f"{REFINER}.attn.to_{x}", f"{ORIGINAL_REFINER}.self_attn_qkv") for x in "qkv"),
    (f"{REFINER}.attn.to_out.0", f"{ORIGINAL_REFINER}.self_attn_proj"),
    (f"{REFINER}.ff.net.0.proj", f"{ORIGINAL_REFINER}.mlp.fc1"),
    (f"{REFINER}.ff.net.2", f"{ORIGINAL_REFINER}.mlp.fc2"),
    (f"{REFINER}.norm_out.linear", f"{ORIGINAL_REFINER}.adaLN_modulation.1"),
    ("context_embedder.proj_in", "txt_in.input_embedder"),
    ("transformer_blocks", "double_blocks"),
    *((f"attn.to_{x}", "img_attn_qkv") for x in "qkv"),
    *((f"attn.add_{x}_proj", "txt_attn_qkv") for x in "qkv"),
    ("attn.to_out.0", "img_attn_proj"), ("attn.to_add_out", "txt_attn_proj"),
    ("norm1.linear", "img_mod.linear"), ("norm1_context.linear", "txt_mod.linear"),
    ("ff.net.0.proj", "img_mlp.fc1"), ("ff.net.2", "img_mlp.fc2"),
    ("ff_context.net.0.proj", "txt_mlp.fc1"), ("ff_context.net.2", "txt_mlp.fc2"),
    ("proj_out", "final_layer.linear"),
)  # fmt: skip
FUSED_QKV = (tuple(f"attn.to_{x}" for x in "qkv"), tuple(f"attn.add_{x}_proj" for x in "qkv"))


@dataclass(frozen=True)
class HunyuanVideo15(FlowFamily):
    text_subfolders: tuple[tuple[str, str], ...] = (
        ("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"),
    )  # fmt: skip
    comfy_lora: ComfyLora = ComfyLora(renames=ORIGINAL_NAMES, fused=FUSED_QKV)

    def trains(self, parameter: str) -> bool:
        """Not the image projection: text-to-video multiplies it by zero (tests/
        test_hunyuan_video15.py: exactly the parameters without a gradient)."""
        return not parameter.startswith("image_embedder.")

    def pipeline_class(self) -> type:
        """Its pipeline (HunyuanVideo15Pipeline; image-to-video's for hunyuanvideo15i2v) with
        diffusers' HunyuanVideo LoRA loader (they have none)."""
        from zerotuner.families.registry import REGISTRY

        return lora_pipeline(REGISTRY[self.name].pipeline)

    def open_pipeline(self, folder: Path, cls: type | None = None, **kwargs: Any) -> Any:
        """As its LoRA pipeline unless told otherwise: the folder's own class has no loader."""
        return super().open_pipeline(folder, cls or self.pipeline_class(), **kwargs)

    def lora_load_code(self, source: str, *, into_transformer_2: bool = False) -> str:
        """Into the transformer: HunyuanVideo15Pipeline has no `load_lora_weights`."""
        from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE  # the adapter's file

        return (f'pipe.transformer.load_lora_adapter("{source}", subfolder="final", '
                f'weight_name="{LORA_WEIGHT_NAME_SAFE}", prefix="transformer")')  # fmt: skip

    @torch.no_grad()
    def encode_latents(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        return hunyuan_video15_latents(vae, pixels)  # scaled only, one clip at a time

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """HunyuanVideo15Pipeline's own prompt encoders, Qwen's cut at the max sequence
        length (its 1000 by default), on the encoders' execution device (Qwen streams layer by
        layer while caching)."""
        from diffusers import HunyuanVideo15Pipeline as Pipeline

        from zerotuner.families.flux2 import execution_device

        (qwen, byt5), (tokenizer, tokenizer_2) = encoders, tokenizers
        embeds, mask = Pipeline._get_mllm_prompt_embeds(
            text_encoder=qwen, tokenizer=tokenizer, prompt=captions, device=execution_device(qwen),
            tokenizer_max_length=self.max_sequence_length,
        )  # fmt: skip
        glyphs, glyph_mask = Pipeline._get_byt5_prompt_embeds(
            tokenizer=tokenizer_2, text_encoder=byt5, prompt=captions,
            device=execution_device(byt5),
            tokenizer_max_length=GLYPH_TOKENS,
        )  # fmt: skip
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask,
                "prompt_embeds_2": glyphs, "prompt_embeds_mask_2": glyph_mask}  # fmt: skip

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "encoder_attention_mask": batch["prompt_embeds_mask"].to(dtype),
            "encoder_hidden_states_2": batch["prompt_embeds_2"].to(dtype),
            "encoder_attention_mask_2": batch["prompt_embeds_mask_2"].to(dtype),
        }

    def flow_config(self, settings: Any, scheduler: Any) -> Any:
        """The settings' sigma sampling at the reference trainer's shift, 3.0."""
        from dataclasses import replace

        return replace(super().flow_config(settings, scheduler), shift=TRAIN_SHIFT)

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        width = int(model_config.get("image_embed_dim", 1152))
        return HunyuanVideo15Objective(self.flow_config(settings, scheduler), image_width=width)

    def pipeline_kwargs(self, settings: Any) -> dict[str, Any]:
        return {}  # its call takes no max_sequence_length: Qwen's 1000 tokens always

    def frame_step(self, source: Any) -> int:
        """Clips of step * k + 1 frames: the VAE's temporal compression (4x)."""
        from zerotuner.families.shapes import video_scales

        return video_scales(Path(source))[0]

    def latent_multiple(self, model_config: Any) -> int:
        return int(model_config.patch_size)


@functools.cache  # one class a pipeline: diffusers' registries and pickles see the same type
def lora_pipeline(pipeline: str = "HunyuanVideo15Pipeline") -> type:
    """The diffusers pipeline class named `pipeline` (HunyuanVideo15Pipeline or
    HunyuanVideo15ImageToVideoPipeline) with diffusers' HunyuanVideo LoRA loader:
    `save_lora_weights` and `load_lora_weights` for its one `transformer` part."""
    import diffusers
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin

    base = getattr(diffusers, pipeline)
    doc = f"{pipeline} that loads and saves LoRA adapters."
    name = pipeline.replace("Pipeline", "LoraPipeline")  # HunyuanVideo15LoraPipeline
    return type(name, (base, HunyuanVideoLoraLoaderMixin), {"__doc__": doc})
