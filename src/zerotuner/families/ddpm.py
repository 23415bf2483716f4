"""The UNet families' objective: noise or velocity prediction on the DDPM schedule (SD 1.x/2.x,
SDXL), and the helpers every objective uses to reach the denoiser's device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.errors import ConfigError


def prediction_type(scheduler: Any, override: str = "auto") -> str:
    """epsilon or v_prediction: the setting wins, else the model's scheduler (SD 2.x 768: v)."""
    kind = scheduler.config.prediction_type if override == "auto" else override
    if kind not in ("epsilon", "v_prediction"):
        raise ConfigError(
            f"ZT_PREDICTION_TYPE=auto: the model's scheduler predicts '{kind}'; "
            "set ZT_PREDICTION_TYPE to epsilon or v_prediction"
        )
    return kind


@dataclass(frozen=True)
class LossConfig:
    prediction_type: str  # epsilon | v_prediction
    snr_gamma: float | None  # min-SNR-gamma weighting (arXiv 2303.09556); None = plain MSE
    noise_offset: float  # adds a per-channel constant to the noise (brightness range)
    timestep_range: tuple[float, float] = (0.0, 1.0)  # the schedule's part trained (fractions)


def diffusion_loss(
    denoiser: Callable[..., Any],
    scheduler: Any,
    latents: torch.Tensor,
    unet_kwargs: dict[str, Any],
    *,
    config: LossConfig,
    generator: torch.Generator,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Noise the latents at random timesteps and regress the model's prediction (in fp32)."""
    batch = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    if config.noise_offset:
        noise += config.noise_offset * torch.randn(
            (batch, latents.shape[1], 1, 1), generator=generator
        )
    steps = scheduler.config.num_train_timesteps
    low, high = (round(fraction * steps) for fraction in config.timestep_range)
    timesteps = torch.randint(low, max(high, low + 1), (batch,), generator=generator)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if config.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    device = device_of(denoiser)
    pred = denoiser(
        noisy.to(device, dtype), timesteps.to(device), **to_device(unet_kwargs, device)
    ).sample
    target = target.to(device)
    if config.snr_gamma is None:
        return masked_mse(pred, target, mask)
    from diffusers.training_utils import compute_snr

    snr = compute_snr(scheduler, timesteps)
    weight = torch.clamp(snr, max=config.snr_gamma)
    weight = weight / (snr + 1) if config.prediction_type == "v_prediction" else weight / snr
    return masked_mse(pred, target, mask, weight=weight.to(device))


def masked_mse(
    pred: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean squared error in fp32, each sample weighted by `weight` (min-SNR) and each
    latent cell by `mask` (batch, 1, h, w) when the batch has loss masks: a sample's error is
    the mean over the cells its mask keeps, so a cell at 0 contributes nothing and each image
    counts alike however much of it is masked (an all-black mask: the sample adds 0)."""
    error = (pred.float() - target.float()) ** 2
    if mask is None and weight is None:
        return error.mean()
    if mask is None:
        per_sample = error.mean(dim=tuple(range(1, error.dim())))
    else:
        cells = mask.to(error.device, torch.float32)
        # (batch, 1, h, w) over (batch, channels, [frames,] h, w)
        cells = cells.reshape(cells.shape[0], 1, *[1] * (error.dim() - 4), *cells.shape[-2:])
        cells = cells.expand_as(error)
        dims = tuple(range(1, error.dim()))
        per_sample = (error * cells).sum(dim=dims) / cells.sum(dim=dims).clamp_min(1e-6)
    return (per_sample if weight is None else per_sample * weight).mean()


@dataclass(frozen=True)
class DDPMObjective:
    """The UNet families' objective: noise or velocity prediction on the DDPM schedule."""

    scheduler: Any
    config: LossConfig

    def describe(self) -> str:
        low, high = self.config.timestep_range
        part = "" if (low, high) == (0.0, 1.0) else f", timesteps {low:g}-{high:g} of the schedule"
        return f"{self.config.prediction_type} prediction{part}"

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
        return diffusion_loss(
            model, self.scheduler, latents, kwargs, config=self.config, generator=generator,
            dtype=dtype, mask=mask,
        )  # fmt: skip


def device_of(module: Any) -> torch.device:
    device = getattr(module, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):  # Z-Image's captions: one tensor each
        return [to_device(v, device) for v in value]
    return value
