"""What a model family is to the trainer: one small interface, one module per family.

The worker, the loop, the feature cache, checkpoints, samples and export see a family only
through a `ModelFamily`: which pipeline part trains (the UNet, or a transformer), how its text
encoders turn captions into the model's conditioning, which objective trains it (DDPM noise or
velocity prediction, or flow matching) and how latents map onto its input. A new family is a
module with one subclass and a line in `families.REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import torch

from zerotuner.families.registry import REGISTRY

if TYPE_CHECKING:
    from zerotuner.settings.schema import Settings

# Token ids, one row per text encoder: stacked when the encoders share a length (the UNet
# families), a list when they do not (SD3's and Flux's T5 reads longer captions than CLIP).
TokenIds = torch.Tensor | list[torch.Tensor]


class TextParts(Protocol):
    """What a family encodes captions with (train.model.Components has them): the family
    layer reads these two and knows nothing of the rank side that loads them."""

    text_encoders: list[Any]
    tokenizers: list[Any]


class Objective(Protocol):
    def loss(
        self,
        model: Any,
        latents: torch.Tensor,
        kwargs: dict[str, Any],
        *,
        generator: torch.Generator,
        dtype: torch.dtype,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The training loss of one micro-batch (fp32), noise drawn from `generator`; `mask`
        (batch, 1, h, w): each latent cell's weight (loss masks, `ddpm.masked_mse`)."""
        ...

    def describe(self) -> str:
        """What the log says it trains: `epsilon prediction`, `flow matching (...)`."""
        ...


@dataclass(frozen=True)
class ComfyLora:
    """The LoRA key names ComfyUI's loader maps onto a family's model, as
    `weights/lora_layouts.comfy` writes them. Read in comfyanonymous/ComfyUI: comfy/lora.py at
    41444b5236c6 (`model_lora_keys_unet`: `lora_unet_<diffusers UNet module>` through
    `unet_to_diffusers`, `transformer.<diffusers module>` for SD3 and the Flux classes, which
    Chroma and Flux2 subclass, Qwen-Image and Lumina2/Z-Image, and `diffusion_model.<original
    module>` for every model; `model_lora_keys_clip`: `lora_te1_text_model_...`) and
    comfy/lora_convert.py at ee9834b8ca0d; HunyuanVideo's branch (`transformer.<checkpoint
    name>`, for HunyuanVideo15 too) in Comfy-Org/ComfyUI at 17358c8f."""

    # kohya's names (`lora_unet_<module, dots as underscores>.lora_down.weight`, `.lora_up`,
    # `.alpha`; `lora_te1_text_model_...` for CLIP): the UNet families
    kohya: bool = False
    prefix: str = "transformer."  # else: peft's names (`lora_A` / `lora_B`) after this prefix
    # diffusers' module names to the original checkpoint's, whole dotted parts, in order: for a
    # model whose diffusers names ComfyUI does not map (Wan); `*` is any one part (a block's
    # index), the same part on both sides
    renames: tuple[tuple[str, str], ...] = ()
    # diffusers' layers that ComfyUI's model holds as one weight, their outputs stacked in this
    # order (HunyuanVideo's fused q, k, v), by the last parts of their names: `renames` gives
    # each group's layers one name, and the file one LoRA for it (lora_layouts.stacked)
    fused: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class ModelFamily:
    name: str
    denoiser: str = "unet"  # the trained part: its folder in the pipeline and its attribute
    text_subfolders: tuple[tuple[str, str], ...] = (("text_encoder", "tokenizer"),)
    cache_dtype: torch.dtype = torch.float32  # of the cached text embeddings
    # the layout of pytorch_lora_weights_comfyui.safetensors: kohya's for the UNet families
    comfy_lora: ComfyLora = ComfyLora(kohya=True)

    @property
    def sample_input(self) -> str:
        """What its pipeline samples from besides the prompt (`Spec.sample_input`)."""
        return REGISTRY[self.name].sample_input

    def configured(self, settings: Settings, source: Path | None = None) -> Self:
        """The family as this run's settings configure it (flow families: the T5 length; Wan
        2.2 A14B: the expert trained, read with its boundary from the pipeline at `source`)."""
        return self

    def frame_step(self, source: Path) -> int | None:
        """A video family's frame rule: clips train step * k + 1 frames (its VAE's temporal
        compression). None: an image family (clips in the data are not read)."""
        return None

    def trains(self, parameter: str) -> bool:
        """Whether a full fine-tuning trains the denoiser's parameter of that name (LTX-2: not
        its audio stream's); the others are frozen as loaded."""
        return True

    @torch.no_grad()
    def encode_latents(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> the latents it trains on, normalised as its pipeline decodes them
        (the distribution's mean: deterministic, cacheable). A VAE with per-channel
        `latents_mean` / `latents_std` (Qwen-Image's, Wan's: video VAEs) encodes a clip (an
        image as one frame); the others are shifted and scaled by their config."""
        mean = getattr(vae.config, "latents_mean", None)
        if mean is not None:
            frames = pixels.ndim == 5  # (batch, channels, frames, h, w): clips of a video family
            clip = pixels.to(vae.device, vae.dtype)
            clip = clip if frames else clip.unsqueeze(2)
            latents = vae.encode(clip).latent_dist.mean.float().cpu()
            latents = latents if frames else latents.squeeze(2)
            view = (1, len(mean), *[1] * (latents.ndim - 2))
            std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(view)
            return (latents - torch.tensor(mean, dtype=torch.float32).view(view)) / std
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((latents - shift) * vae.config.scaling_factor).float().cpu()

    # --- parts --------------------------------------------------------------------------
    def denoiser_class(self) -> type:
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel

    def scheduler_class(self) -> type:
        from diffusers import DDPMScheduler

        return DDPMScheduler

    def pipeline_class(self) -> type:
        """The family's diffusers pipeline (its `save_lora_weights` writes the adapter layout)."""
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def open_pipeline(self, folder: Path, cls: type | None = None, **kwargs: Any) -> Any:
        """A pipeline folder of this family as diffusers loads it, able to load a LoRA adapter
        (`load_lora_weights`): as `cls`, else as the class its model_index.json names;
        `kwargs` go to from_pretrained."""
        from diffusers import DiffusionPipeline

        loader: Any = cls or DiffusionPipeline
        return loader.from_pretrained(folder, **kwargs)

    def lora_load_code(self, source: str, *, into_transformer_2: bool = False) -> str:
        """The line of diffusers that loads the adapter in `source`'s final/ onto `pipe`, the
        family's pipeline as diffusers loads it (a model card shows it)."""
        into = ", load_into_transformer_2=True" if into_transformer_2 else ""
        return f'pipe.load_lora_weights("{source}", subfolder="final"{into})'

    def load_text(self, source: Path, *, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
        """The text encoders (each the transformers class its model_index names) and their
        tokenizers (or processors)."""
        import json

        import transformers
        from transformers import AutoProcessor, AutoTokenizer

        index = json.loads((source / "model_index.json").read_text())
        encoders, tokenizers = [], []
        for encoder_dir, tokenizer_dir in self.text_subfolders:
            cls = getattr(transformers, index[encoder_dir][1])
            encoders.append(cls.from_pretrained(source, subfolder=encoder_dir, dtype=dtype))
            # a processor (FLUX.2 [dev]'s PixtralProcessor) holds the chat template it encodes by
            auto = AutoProcessor if index[tokenizer_dir][1].endswith("Processor") else AutoTokenizer
            tokenizers.append(auto.from_pretrained(source, subfolder=tokenizer_dir))
        return encoders, tokenizers

    # --- conditioning ---------------------------------------------------------------------
    @staticmethod
    def tokenize(
        tokenizer: Any, captions: list[str], max_length: int | None = None
    ) -> torch.Tensor:
        return tokenizer(
            captions,
            padding="max_length",
            max_length=max_length or tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids

    def tokens(self, tokenizers: list[Any], captions: list[str]) -> TokenIds:
        """Token ids of every encoder, stacked: (encoders, captions, max length) on the CPU."""
        return torch.stack([self.tokenize(t, captions) for t in tokenizers])

    def embed(self, encoders: list[Any], ids: TokenIds) -> dict[str, torch.Tensor]:
        """The model's text conditioning from token ids, with gradients (encoders that train:
        lora_text.py). SD 1.x/2.x: the text encoder's last hidden state."""
        (encoder,) = encoders
        return {"prompt_embeds": encoder(ids[0]).last_hidden_state}

    @torch.no_grad()
    def encode_text(self, components: TextParts, captions: list[str]) -> dict[str, torch.Tensor]:
        """`embed` once per caption at caching time: per-example tensors on the CPU."""
        encoders = components.text_encoders
        ids = [i.to(encoders[0].device) for i in self.tokens(components.tokenizers, captions)]
        embeds = self.embed(encoders, ids)
        return {k: v.to(self.cache_dtype).cpu() for k, v in embeds.items()}

    def text_cache_tag(self) -> str:
        """What else than the encoders' files decides a cached caption (part of its key)."""
        return ""

    # --- what a cached latent holds besides the latents --------------------------------------
    def latent_subfolders(self) -> list[str]:
        """The pipeline folders whose files decide a cached latent (part of its key)."""
        return ["vae"]

    def latent_cache_tag(self) -> str:
        """What else than those files decides a cached latent (part of its key)."""
        return ""

    def load_image_encoder(self, source: Path, device: torch.device) -> Any:
        """A frozen image encoder the cached latents need beside the VAE (Wan 2.1 I2V's CLIP),
        loaded while caching; None: none."""
        return None

    def encode_conditions(
        self, pixels: torch.Tensor, encode: Callable[[torch.Tensor], torch.Tensor],
        image_encoder: Any = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """What else a batch of pixels is cached as, beside its latents (`encode`: the VAE's
        latents of pixels): Wan I2V's first frame's condition latents and image states."""
        return {}

    def encode_item_captions(
        self, encoders: list[Any], tokenizers: list[Any], captions: list[str],
        controls: torch.Tensor,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """The captions' states of a family whose text encoder also reads each item's control
        images (`controls`: batch, controls, C, H, W in [-1, 1]; Spec.captions_per_item):
        cached in the items' latent entries, on the CPU. Qwen-Image-Edit's Qwen2.5-VL."""
        return {}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """The keyword arguments of the denoiser's forward from a batch holding embeddings."""
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}

    # --- training -------------------------------------------------------------------------
    def objective(self, settings: Settings, scheduler: Any, model_config: Any) -> Objective:
        from zerotuner.families.ddpm import DDPMObjective, LossConfig, prediction_type

        config = LossConfig(
            prediction_type(scheduler, settings.prediction_type), settings.snr_gamma,
            settings.noise_offset, settings.timesteps,
        )  # fmt: skip
        return DDPMObjective(scheduler, config)

    def latent_multiple(self, model_config: Any) -> int:
        """Latent cells a bucket side must be a multiple of: the UNet halves it per level."""
        return 2 ** (len(model_config.block_out_channels) - 1)

    def pipeline_kwargs(self, settings: Settings) -> dict[str, Any]:
        """Extra arguments of the family's pipeline call for validation samples."""
        return {}
