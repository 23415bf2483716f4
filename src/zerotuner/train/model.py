"""Loading a diffusers pipeline's parts.

The denoiser (a UNet, or a transformer) is trained. The VAE and text encoders are frozen:
they encode the dataset once (see cache.py) and are then dropped. What distinguishes the
families lives in one module per family (families/), so the training loop has no family
flags. This module knows nothing about distribution: deepspeed.initialize is in run.py.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.families import hub_cache_dir
from zerotuner.weights import base_precision, zero_init

log = logging.getLogger(__name__)

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


def fetch_model(
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
    denoiser: Any  # the trained denoiser: the UNet, or a transformer family's transformer
    scheduler: Any  # DDPMScheduler: adds noise, gives SNR and velocity targets
    vae: Any = None
    text_encoders: list[Any] = field(default_factory=list)
    tokenizers: list[Any] = field(default_factory=list)
    image_encoder: Any = None  # the family's, for its cached latents (Wan 2.1 I2V's CLIP)

    def drop_frozen(self) -> None:
        """After caching, the VAE and text encoders leave the device and the host before the
        engine starts: their memory goes back, not into PyTorch's or glibc's free lists."""
        self.vae = None
        self.text_encoders = []
        self.tokenizers = []
        self.image_encoder = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        zero_init.trim()


def load_denoiser(
    source: Path,
    *,
    gradient_checkpointing: bool,
    family: str = "sdxl",
    deepspeed_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    denoiser: str | None = None,
    offload_activations: str = "none",
) -> Any:
    """The trainable denoiser (the family's UNet or transformer; `denoiser`: the pipeline
    folder it is in when not the family's own, Wan 2.2 A14B's expert). At ZeRO-3 (`deepspeed_config`
    given, stage 3) it is built inside deepspeed.zero.Init, each rank holding its partition
    only (zero_init.py); else whole in `dtype`: fp32 for full training (DeepSpeed makes its
    masters from it), the run's 16-bit dtype for a LoRA base, which DeepSpeed would cast to it
    anyway and which has no masters."""
    kind = families.get(family)
    part = denoiser or kind.denoiser
    model = None
    if zero_init.wanted(deepspeed_config):
        assert deepspeed_config is not None
        model = zero_init.build(kind.denoiser_class(), source / part, deepspeed_config)
    if model is None:
        model = kind.denoiser_class().from_pretrained(source, subfolder=part, dtype=dtype)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing(checkpoint_function(offload_activations))
        if offload_activations == "cpu":
            log.info("gradient checkpointing: each block's input waits in host memory until "
                     "the backward recomputes the block (ZT_OFFLOAD_ACTIVATIONS=cpu)")  # fmt: skip
    model.train()
    return model


def checkpoint_function(offload_activations: str) -> Any:
    """What a checkpointed block runs through: diffusers' default (None: torch's
    non-reentrant checkpoint), or with ZT_OFFLOAD_ACTIVATIONS=cpu the same checkpoint of a block
    whose input waits in host memory (pinned, copied without blocking on CUDA) until the
    backward recomputes the block; the device copy is freed as soon as the next block no longer
    needs it, so only one block's input at a time is on the device.

    Not DeepSpeed's `cpu_checkpointing`: it empties each checkpointed tensor in place once the
    block has run, which breaks blocks that share tensors (Wan's text states, timestep
    projection and RoPE go to every block), and on the CPU accelerator its saved copy is the
    emptied tensor itself (DeepSpeed 0.18: `arg.saved_data = inp.data` after `arg.data` was
    emptied, `inp` aliasing `arg`), so its recompute fails."""
    if offload_activations != "cpu":
        return None
    from torch.utils.checkpoint import checkpoint

    def offloaded(block: Any, hidden_states: torch.Tensor, *shared: Any, **named: Any) -> Any:
        device = hidden_states.device
        pinned = device.type == "cuda"
        host = hidden_states.to("cpu", non_blocking=pinned)
        return checkpoint(_on_device, block, device, host, shared, named, use_reentrant=False)

    return offloaded


def _on_device(
    block: Any, device: torch.device, host: torch.Tensor, shared: tuple[Any, ...],
    named: dict[str, Any],
) -> Any:  # fmt: skip
    """A block run on its input brought back from host memory (the recompute does it again)."""
    return block(host.to(device, non_blocking=True), *shared, **named)


def load_frozen(
    components: Components,
    *,
    device: torch.device,
    text_dtype: torch.dtype,
    text_precision: str = "auto",
) -> None:
    """VAE (fp32: the SDXL VAE overflows in fp16) and the family's text encoders, eval mode;
    `text_precision` fp8 or int8 stores the encoders' blocks' Linear layers so
    (ZT_TEXT_ENCODER_PRECISION, base_precision), before a streamed one leaves for the host."""
    vae = vae_class(components.source).from_pretrained(
        components.source, subfolder="vae", dtype=torch.float32
    )
    components.vae = vae.to(device).eval().requires_grad_(False)
    family = families.get(components.family)
    components.image_encoder = family.load_image_encoder(components.source, device)
    encoders, tokenizers = family.load_text(components.source, dtype=text_dtype)
    if base_precision.is_low(text_precision):
        for i, encoder in enumerate(encoders):
            stored = base_precision.quantize_frozen_base(
                encoder, text_precision, setting="text_encoder_precision"
            )
            log.info("%s", stored.line(f"text encoder {i + 1} ({type(encoder).__name__})"))
    stream = device.type != "cpu" and families.REGISTRY[components.family].text_stream_params
    components.text_encoders = [
        streamed(e, device) if stream else e.to(device) for e in encoders
    ]  # fmt: skip
    for encoder in components.text_encoders:
        encoder.eval().requires_grad_(False)
    components.tokenizers = tokenizers


def streamed(encoder: Any, device: torch.device) -> Any:
    """A text encoder too large for the device (FLUX.2 [dev]'s 24B Mistral: ~48 GB in bf16),
    kept in host memory and streamed to `device` one layer at a time as it runs (accelerate's
    `cpu_offload`, as diffusers' `enable_sequential_cpu_offload`); the planner counts its
    largest layer on the device while caching."""
    from accelerate import cpu_offload

    return cpu_offload(encoder, execution_device=device)


def load_components(
    source: Path,
    family: str,
    *,
    gradient_checkpointing: bool,
    with_frozen: bool = True,
    deepspeed_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    denoiser: str | None = None,
    offload_activations: str = "none",
) -> Components:
    """`deepspeed_config`: the run's effective DeepSpeed config (None outside a training rank);
    `dtype`: the denoiser's below ZeRO-3, `denoiser` its folder, `offload_activations` where
    its checkpointed blocks' inputs wait (see load_denoiser)."""
    kind = families.get(family)
    scheduler = kind.scheduler_class().from_pretrained(source, subfolder="scheduler")
    trained = load_denoiser(
        source, gradient_checkpointing=gradient_checkpointing, family=family,
        deepspeed_config=deepspeed_config, dtype=dtype, denoiser=denoiser,
        offload_activations=offload_activations,
    )  # fmt: skip
    components = Components(family=family, source=source, denoiser=trained, scheduler=scheduler)
    if with_frozen:
        load_frozen(components, device=torch.device("cpu"), text_dtype=torch.float32)
    return components


def vae_class(source: Path) -> type[Any]:
    """The VAE's class as the pipeline's model_index.json names it (AutoencoderKL, or
    Qwen-Image's AutoencoderKLQwenImage)."""
    import importlib
    import json

    index = source / "model_index.json"
    library, name = ("diffusers", "AutoencoderKL")
    if index.is_file():
        library, name = json.loads(index.read_text()).get("vae", (library, name))
    return getattr(importlib.import_module(library), name)


@torch.no_grad()
def encode_images(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] -> scaled latents (the distribution's mean: deterministic, cacheable).
    A VAE with per-channel `latents_mean` / `latents_std` (Qwen-Image's, Wan's: video VAEs)
    encodes a clip (an image as one frame) and is normalised by those, as the pipelines
    decode; FLUX.2's by its batch norm's statistics (`families.flux2.flux2_latents`)."""
    if getattr(vae, "bn", None) is not None:  # FLUX.2's AutoencoderKLFlux2
        from zerotuner.families.flux2 import flux2_latents

        return flux2_latents(vae, vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
    if type(vae).__name__ == "AutoencoderKLLTX2Video":  # its statistics are buffers
        from zerotuner.families.ltx2 import ltx2_latents

        return ltx2_latents(vae, pixels)
    if type(vae).__name__ == "AutoencoderKLHunyuanVideo15":  # 5-D only, scaled, no mean
        from zerotuner.families.hunyuan_video15 import hunyuan_video15_latents

        return hunyuan_video15_latents(vae, pixels)
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
