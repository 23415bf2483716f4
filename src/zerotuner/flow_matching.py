"""Flow matching, the objective SD3 and Flux are trained with (rectified flow, arXiv 2403.03206).

A latent x travels in a straight line to Gaussian noise n: at sigma in [0, 1] the model sees
`(1 - sigma) x + sigma n` and regresses the velocity `n - x`. Sigmas are drawn by a density
over [0, 1] (`logit_normal`, SD3's default; `uniform`; `mode` with its scale) through
diffusers' own sampler, then shifted as the model's FlowMatchEulerDiscreteScheduler shifts its
sigmas (SD3: shift 3.0; a scheduler with dynamic shifting, as Flux's, trains unshifted, as
diffusers' Flux example does). Flux sees its latents as a sequence of 2x2 patches with
(0, row, column) position ids: `pack`, `unpack` and `image_ids` are FluxPipeline's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Weighting = Literal["logit_normal", "uniform", "mode"]


@dataclass(frozen=True)
class FlowConfig:
    weighting: Weighting = "logit_normal"
    logit_mean: float = 0.0  # logit_normal: mean and std of the normal before the sigmoid
    logit_std: float = 1.0
    mode_scale: float = 1.29  # mode: how strongly the middle sigmas are favoured
    shift: float = 1.0  # the scheduler's static shift (1.0: none)
    num_train_timesteps: int = 1000

    @classmethod
    def from_scheduler(cls, config: Any, **sampling: Any) -> FlowConfig:
        """The shift and timestep scale a FlowMatchEulerDiscreteScheduler config trains with."""
        shift = 1.0 if config.get("use_dynamic_shifting") else float(config.get("shift", 1.0))
        steps = int(config.get("num_train_timesteps", 1000))
        return cls(shift=shift, num_train_timesteps=steps, **sampling)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's static shift: more of the draws at high noise for shift > 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_sigmas(batch: int, config: FlowConfig, generator: torch.Generator) -> torch.Tensor:
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        config.weighting, batch, logit_mean=config.logit_mean, logit_std=config.logit_std,
        mode_scale=config.mode_scale, generator=generator,
    )  # fmt: skip
    return shift_sigmas(u, config.shift)


def noisy_and_target(
    latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's input at each sample's sigma, and the velocity it must predict."""
    s = sigmas.view(-1, *[1] * (latents.ndim - 1)).to(latents.dtype)
    return (1 - s) * latents + s * noise, noise - latents


def timesteps(sigmas: torch.Tensor, config: FlowConfig) -> torch.Tensor:
    """What the transformers take as the timestep: sigma on the scheduler's 0-1000 scale."""
    return sigmas * config.num_train_timesteps


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, height, width) -> (batch, height/2 * width/2, channels * 4)."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`pack` undone, for latents of `height` x `width` cells."""
    from diffusers import FluxPipeline

    return FluxPipeline._unpack_latents(packed, height, width, vae_scale_factor=1)


def image_ids(height: int, width: int) -> torch.Tensor:
    """Position ids (0, row, column) of the packed patches of a `height` x `width` latent."""
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, "cpu", torch.float32)
