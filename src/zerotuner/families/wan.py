"""Wan 2.1 / 2.2 text-to-video (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B, Wan2.2-TI2V-5B): a
video DiT (WanTransformer3DModel: 3D patches of (1, 2, 2) latent cells, cross-attention to the
text) conditioned on UMT5-XXL's last hidden states, with a causal video VAE (AutoencoderKLWan:
latents normalised by a per-channel mean and std) and a flow-matching scheduler with a static
shift (the published one is UniPCMultistepScheduler with flow sigmas and `flow_shift` 3.0).
It trains on clips (latents (batch, channels, frames, h, w), data/clips.py) and on images
as one-frame clips.

What it trains on is what WanPipeline samples with (diffusers 0.42, pipelines/wan/
pipeline_wan.py):
- captions: `prompt_clean`, UMT5 tokens padded to max_sequence_length (default 512) with the
  attention mask, the encoder's last hidden state computed with that mask, and every state past
  the caption's real tokens set to zero (`_get_t5_prompt_embeds`: `u[:v]` then `new_zeros`);
  the transformer takes them as `encoder_hidden_states`, without a mask;
- latents `(x - latents_mean) / latents_std` (the pipeline decodes `latents * std + mean`), a
  clip (or an image as one frame) encoded through the video VAE (`ModelFamily.encode_latents`);
- the transformer takes the noised clip and the timestep on the scheduler's 0-1000 scale.

The noise schedule is musubi-tuner's for Wan (kohya-ss/musubi-tuner at 30c658c4,
src/musubi_tuner/training/trainer_base.py `get_noisy_model_input_and_timesteps`,
`--timestep_sampling shift`, which docs/wan.md recommends with `--discrete_flow_shift 3.0`):
`t = sigmoid(randn)` (ZT_WEIGHTING_SCHEME's logit_normal(0, 1), the default), shifted as
`shift t / (1 + (shift - 1) t)`, the input `(1 - t) x + t n`, the timestep `t * 1000`, the target
`noise - x` (src/musubi_tuner/wan_train_network.py). The shift here is the model's own: its
scheduler's `flow_shift` (UniPC) or `shift` (FlowMatchEulerDiscreteScheduler), 3.0 for
Wan2.1-T2V-1.3B as musubi's example. finetrainers (a-r-r-o-w/finetrainers at f476c371,
finetrainers/models/wan/base_specification.py `forward`) trains the same noising and target
with the timestep `(sigma * 1000).long()`. Wan 2.2 TI2V-5B's pipeline (`expand_timesteps`)
gives every latent token its own timestep, all equal without a conditioning image: the same
embedding as one timestep per clip, which is what this passes.

Wan 2.2 T2V A14B is two such transformers, experts by noise level: WanPipeline runs
`transformer` at the timesteps t >= boundary_ratio * 1000 (the noisy ones: sigma >= the
boundary) and `transformer_2` below. A run trains one (ZT_EXPERT: `configured`): its folder is
the denoiser everywhere (loading, checkpoints, export, samples), its sigmas the expert's part of
the schedule through ZT_TIMESTEP_RANGE's path (`FlowConfig.timestep_range`), and the export a
whole WanPipeline folder with the other expert as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import torch

from zerotuner.families.base import ComfyLora
from zerotuner.families.flow import FlowFamily
from zerotuner.families.flow_matching import FlowObjective


class PipelineScheduler:
    """Loads the scheduler its scheduler_config.json names: Wan's published
    UniPCMultistepScheduler (flow sigmas, `flow_shift`), or FlowMatchEulerDiscreteScheduler
    (`shift`), which WanPipeline takes as well."""

    @staticmethod
    def from_pretrained(source: Any, subfolder: str = "scheduler", **kwargs: Any) -> Any:
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(source, subfolder=subfolder, **kwargs)
        cls = getattr(diffusers, str(config.get("_class_name")), FlowMatchEulerDiscreteScheduler)
        return cls.from_config(config)


@dataclass(frozen=True)
class WanObjective(FlowObjective):
    """SD3's unpacked flow matching on a clip: a clip's 5-D latents as they are, an image's
    as one frame. `expert`: A14B's expert trained (`high`, `low`; "" none), on `expert_range`."""

    expert: str = ""
    expert_range: tuple[float, float] = (0.0, 1.0)

    def describe(self) -> str:
        if not self.expert:
            return super().describe()
        from zerotuner.families.wan_variants import EXPERTS

        low, high = self.expert_range
        return (f"{self.expert}-noise expert ({EXPERTS[self.expert]}), sigmas in "
                f"{low:g}-{high:g}: {super().describe()}")  # fmt: skip

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        image = latents.ndim == 4  # (batch, channels, height, width): one frame
        clip = latents.unsqueeze(2) if image else latents
        out = model(hidden_states=clip, timestep=t, **kwargs).sample
        return out.squeeze(2) if image else out


# Wan's diffusers module names to the original checkpoint's, which ComfyUI's model has (it maps
# no diffusers names for Wan): the inverse of diffusers' TRANSFORMER_KEYS_RENAME_DICT
# (diffusers 0.42 loaders/single_file_utils.py `convert_wan_transformer_to_diffusers`, as
# scripts/convert_wan_to_diffusers.py), for the layers LoRA wraps
WAN_ORIGINAL_NAMES = (
    ("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
    ("attn1.to_out.0", "self_attn.o"),
    ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"), ("attn2.to_v", "cross_attn.v"),
    ("attn2.to_out.0", "cross_attn.o"), ("attn2.add_k_proj", "cross_attn.k_img"),
    ("attn2.add_v_proj", "cross_attn.v_img"),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("proj_out", "head.head"),
)  # fmt: skip


@dataclass(frozen=True)
class Wan(FlowFamily):
    expert: str = ""  # ZT_EXPERT: A14B's expert trained (`denoiser` is its folder)
    boundary: float | None = None  # A14B's boundary_ratio (model_index.json)
    # ComfyUI's Wan model has the original checkpoint's names (both A14B experts alike: each
    # loads as a model of its own there)
    comfy_lora: ComfyLora = ComfyLora(prefix="diffusion_model.", renames=WAN_ORIGINAL_NAMES)

    def configured(self, settings: Any, source: Path | None = None) -> Self:
        """With ZT_EXPERT: the expert's folder as the denoiser, and the boundary between the
        experts read from the pipeline at `source`."""
        family = super().configured(settings, source)
        if not settings.expert:
            return family
        from zerotuner.families.shapes import boundary_ratio
        from zerotuner.families.wan_variants import EXPERTS

        boundary = boundary_ratio(Path(source)) if source is not None else None
        return replace(family, denoiser=EXPERTS[settings.expert], expert=settings.expert,
                       boundary=boundary)  # fmt: skip

    def scheduler_class(self) -> type:
        return PipelineScheduler

    def encode_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str]
    ) -> dict[str, torch.Tensor]:
        """WanPipeline._get_t5_prompt_embeds: UMT5's masked states, zero past the caption."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        (encoder,), (tokenizer,) = encoders, tokenizers
        tokens = tokenizer(
            [prompt_clean(caption) for caption in captions], padding="max_length",
            max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        ).to(encoder.device)  # fmt: skip
        states = encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state
        kept = tokens.attention_mask.gt(0).unsqueeze(-1).to(states.dtype)
        return {"prompt_embeds": states * kept}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}

    def flow_config(self, settings: Any, scheduler: Any) -> Any:
        """The settings' sigma sampling with the scheduler's static shift: UniPC's
        `flow_shift` (FlowMatchEulerDiscreteScheduler's `shift` as the other families)."""
        config = super().flow_config(settings, scheduler)
        shift = scheduler.config.get("flow_shift")
        if shift is not None and scheduler.config.get("use_flow_sigmas"):
            config = replace(config, shift=float(shift))
        if self.expert:  # A14B: the expert's sigmas (or ZT_TIMESTEP_RANGE's inside them)
            from zerotuner.families.wan_variants import expert_sigmas

            config = replace(config, timestep_range=expert_sigmas(settings, self.boundary))
        return config

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        config = self.flow_config(settings, scheduler)
        if not self.expert:
            return WanObjective(config)
        from zerotuner.families.wan_variants import expert_range

        assert self.boundary is not None  # flow_config refused a model without one
        return WanObjective(config, expert=self.expert,
                            expert_range=expert_range(self.expert, self.boundary))  # fmt: skip

    def frame_step(self, source: Any) -> int:
        """Clips of step * k + 1 frames: the VAE's temporal compression (Wan 2.1's and 2.2's
        4x; the first frame is encoded alone)."""
        from zerotuner.families.shapes import video_scales

        return video_scales(Path(source))[0]

    def latent_multiple(self, model_config: Any) -> int:
        """The transformer's spatial patch (its patch_size is (frames, height, width))."""
        return int(model_config.patch_size[1])
