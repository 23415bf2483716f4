"""Loading a diffusers pipeline's parts, and the one place where model families differ.

Only the UNet is trained. The VAE and text encoders are frozen: they encode the dataset once
(see cache.py) and are then dropped. Everything that distinguishes SDXL from SD 1.x/2.x (two
text encoders, pooled embeddings, size/crop micro-conditioning) lives in a `Conditioning`
class per family, so the training loop has no family flags. This module knows nothing about
distribution: deepspeed.initialize is called in worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.families import hub_cache_dir

# A diffusers pipeline's own files only: hub repos also hold single-file checkpoints and fp16
# variants (SDXL base: ~20 GB more) that diffusers does not read here.
HUB_FILES = (
    "model_index.json",
    "*/*.json",
    "*/*.txt",
    "*/*.model",
    "*/diffusion_pytorch_model.safetensors",
    "*/diffusion_pytorch_model-*-of-*.safetensors",
    "*/model.safetensors",
    "*/model-*-of-*.safetensors",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


def train_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype DeepSpeed keeps the UNet in (bf16/fp16 enabled in its config, else fp32)."""
    return DTYPES[mixed_precision]


def resolve_model(
    model: str, *, cache_dir: Path, token: str | None = None, revision: str | None = None
) -> Path:
    """A local folder as is; a hub id downloaded once into the HF cache (HF_HOME or cache_dir).

    Call it on one rank per node first, then on the others after a barrier, so only one
    process downloads.
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.is_absolute() or model.startswith("."):
        raise ConfigError(f"ZT_MODEL={model}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        path = snapshot_download(
            model, cache_dir=hub_cache_dir(cache_dir), token=token, revision=revision,
            allow_patterns=list(HUB_FILES),
        )  # fmt: skip
    except (RepositoryNotFoundError, GatedRepoError, HFValidationError) as exc:
        raise ConfigError(
            f"ZT_MODEL={model}: not a hub repository this token can read "
            f"({type(exc).__name__}); give a local pipeline folder or a hub id"
        ) from None
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"ZT_MODEL={model}: not in the model cache and the hub is unreachable or "
            "HF_HUB_OFFLINE is set"
        ) from None
    return Path(path)


@dataclass
class Components:
    """The parts of a pipeline the trainer needs. Frozen parts are None once dropped."""

    family: str
    source: Path  # local folder of the base pipeline (export copies the frozen parts from it)
    unet: Any
    scheduler: Any  # DDPMScheduler: adds noise, gives SNR and velocity targets
    vae: Any = None
    text_encoders: list[Any] = field(default_factory=list)
    tokenizers: list[Any] = field(default_factory=list)

    def drop_frozen(self) -> None:
        """After caching, the VAE and text encoders leave the device (and memory)."""
        self.vae = None
        self.text_encoders = []
        self.tokenizers = []


def load_unet(source: Path, *, gradient_checkpointing: bool) -> Any:
    """The trainable UNet in fp32: DeepSpeed casts it to the configured precision itself."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(source, subfolder="unet", dtype=torch.float32)
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return unet


def load_frozen(components: Components, *, device: torch.device, text_dtype: torch.dtype) -> None:
    """VAE (fp32: the SDXL VAE overflows in fp16) and the family's text encoders, eval mode."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(components.source, subfolder="vae", dtype=torch.float32)
    components.vae = vae.to(device).eval().requires_grad_(False)
    conditioning = CONDITIONING[components.family]
    encoders, tokenizers = conditioning.load_text(components.source, dtype=text_dtype)
    components.text_encoders = [e.to(device).eval().requires_grad_(False) for e in encoders]
    components.tokenizers = tokenizers


def load_components(
    source: Path, family: str, *, gradient_checkpointing: bool, with_frozen: bool = True
) -> Components:
    from diffusers import DDPMScheduler

    if family not in CONDITIONING:
        raise ConfigError(f"ZT_MODEL_FAMILY={family}: expected sdxl, sd1 or sd2")
    scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")
    unet = load_unet(source, gradient_checkpointing=gradient_checkpointing)
    components = Components(family=family, source=source, unet=unet, scheduler=scheduler)
    if with_frozen:
        load_frozen(components, device=torch.device("cpu"), text_dtype=torch.float32)
    return components


def prediction_type(scheduler: Any, override: str = "auto") -> str:
    """epsilon or v_prediction: the setting wins, else the model's scheduler (SD 2.x 768: v)."""
    kind = scheduler.config.prediction_type if override == "auto" else override
    if kind not in ("epsilon", "v_prediction"):
        raise ConfigError(
            f"ZT_PREDICTION_TYPE=auto: the model's scheduler predicts '{kind}'; "
            "set ZT_PREDICTION_TYPE to epsilon or v_prediction"
        )
    return kind


@torch.no_grad()
def encode_images(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] -> scaled latents (the distribution's mean: deterministic, cacheable)."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * vae.config.scaling_factor).float().cpu()


class Conditioning:
    """How one family turns captions and image geometry into UNet inputs.

    `encode_text` runs once per caption at caching time and returns per-example tensors;
    `unet_kwargs` builds the keyword arguments of the UNet's forward from a cached batch.
    """

    text_subfolders: tuple[tuple[str, str], ...] = (("text_encoder", "tokenizer"),)

    def load_text(self, source: Path, *, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

        encoders, tokenizers = [], []
        for encoder_dir, tokenizer_dir in self.text_subfolders:
            cls = CLIPTextModelWithProjection if encoder_dir.endswith("_2") else CLIPTextModel
            encoders.append(cls.from_pretrained(source, subfolder=encoder_dir, dtype=dtype))
            tokenizers.append(AutoTokenizer.from_pretrained(source, subfolder=tokenizer_dir))
        return encoders, tokenizers

    @staticmethod
    def _tokens(tokenizer: Any, captions: list[str], device: torch.device) -> torch.Tensor:
        ids = tokenizer(
            captions,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return ids.to(device)

    @torch.no_grad()
    def encode_text(self, components: Components, captions: list[str]) -> dict[str, torch.Tensor]:
        """SD 1.x/2.x: the text encoder's last hidden state."""
        (encoder,), (tokenizer,) = components.text_encoders, components.tokenizers
        ids = self._tokens(tokenizer, captions, encoder.device)
        return {"prompt_embeds": encoder(ids).last_hidden_state.float().cpu()}

    def unet_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}


class SDXLConditioning(Conditioning):
    """Two encoders' penultimate states side by side, the second's pooled projection, and the
    micro-conditioning time ids (original size, crop top-left, target size) per image."""

    text_subfolders = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))

    @torch.no_grad()
    def encode_text(self, components: Components, captions: list[str]) -> dict[str, torch.Tensor]:
        states, pooled = [], None
        for encoder, tokenizer in zip(components.text_encoders, components.tokenizers, strict=True):
            ids = self._tokens(tokenizer, captions, encoder.device)
            out = encoder(ids, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)
        return {
            "prompt_embeds": torch.cat(states, dim=-1).float().cpu(),
            "pooled_prompt_embeds": pooled.float().cpu(),
        }

    def unet_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "added_cond_kwargs": {
                "text_embeds": batch["pooled_prompt_embeds"].to(dtype),
                "time_ids": batch["time_ids"].to(dtype),
            },
        }


CONDITIONING: dict[str, Conditioning] = {
    "sdxl": SDXLConditioning(),
    "sd1": Conditioning(),
    "sd2": Conditioning(),  # v-prediction comes from the scheduler, not from the family
}


def time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's micro-conditioning vector (height, width pairs), as the SDXL pipeline builds it."""
    return torch.tensor([*original_size, *crop_top_left, *target_size], dtype=torch.float32)
