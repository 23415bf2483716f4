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
    timestep_range: tuple[float, float] = (0.0, 1.0)  # sigmas scaled into it (ZT_TIMESTEP_RANGE)

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
    low, high = config.timestep_range  # the sampled density, squeezed into this part
    return low + (high - low) * shift_sigmas(u, config.shift)


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


@dataclass(frozen=True)
class FlowObjective:
    """Flow matching's loss for a transformer family: SD3 takes the noised latents as they are
    and the timestep on the 0-1000 scale; Flux (`packed`) takes them as a sequence of 2x2
    patches with position ids, sigma itself as the timestep, and the guidance value its
    guidance-distilled checkpoints were trained with (`guidance` None: no such embedding)."""

    config: FlowConfig
    packed: bool = False
    guidance: float | None = None

    def describe(self) -> str:
        c = self.config
        shown = {"logit_normal": f"logit_normal({c.logit_mean:g}, {c.logit_std:g})",
                 "mode": f"mode({c.mode_scale:g})", "uniform": "uniform"}[c.weighting]  # fmt: skip
        guidance = f", guidance {self.guidance:g}" if self.guidance is not None else ""
        low, high = c.timestep_range
        part = "" if (low, high) == (0.0, 1.0) else f", sigmas in {low:g}-{high:g}"
        return f"flow matching (sigmas {shown}, shift {c.shift:g}{part}{guidance})"

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
        from zerotuner.families.ddpm import device_of, masked_mse, to_device

        noise = torch.randn(latents.shape, generator=generator)
        sigmas = self.sigmas(latents, generator)
        noisy, target = noisy_and_target(latents, noise, sigmas)
        noisy = self.kept_clean(latents, noisy)
        device = device_of(model)
        pred = self.predict(model, noisy, sigmas, to_device(kwargs, device), device=device,
                            dtype=dtype)  # fmt: skip
        pred, target = self.scored(pred, target)
        return masked_mse(pred, target.to(device), mask)

    # --- hooks of the loss: a family whose reference trains otherwise overrides one ----------
    def sigmas(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Each example's sigma: ZT_WEIGHTING_SCHEME's density, shifted (sample_sigmas)."""
        return sample_sigmas(latents.shape[0], self.config, generator)

    def kept_clean(self, latents: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """The model's input: the noised latents, where a part of them stays clean."""
        return noisy

    def scored(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of the prediction and target the loss scores: all of it."""
        return pred, target

    def predict(
        self,
        model: Any,
        noisy: torch.Tensor,
        sigmas: torch.Tensor,
        kwargs: dict[str, Any],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The model's velocity for the noised latents (batch, channels, height, width) at
        `sigmas`, in the latents' layout. What differs between the families is in the hooks:
        `pack` / `unpack` (the sequence a packed transformer sees), `timestep`, `packed_inputs`
        (its other keyword arguments) and `call`. An edit family's reference latents
        (`control_latents`: batch, references, channels, height, width) are packed after the
        noisy ones, where `reference_inputs` places them, and only the target's tokens are
        scored."""
        from zerotuner.families.ddpm import to_device

        batch, (height, width) = noisy.shape[0], noisy.shape[-2:]
        t = self.timestep(sigmas).to(device, dtype)
        if not self.packed:
            return self.call(model, noisy.to(device, dtype), t, kwargs)
        references = kwargs.get("control_latents")
        states = {k: v for k, v in kwargs.items() if k != "control_latents"}
        extra = self.packed_inputs(states, batch, height, width)
        target = self.pack(noisy.to(device))
        sequence = [target]
        if references is not None:
            sequence += [self.pack(references[:, k]) for k in range(references.shape[1])]
            extra |= self.reference_inputs(extra, references.shape)
        hidden = torch.cat(sequence, dim=1).to(device, dtype)
        pred = model(hidden_states=hidden, timestep=t, **to_device(extra, device)).sample
        return self.unpack(pred[:, : target.shape[1]], height, width)  # the target's tokens

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The timestep the transformer takes: SD3's on the 0-1000 scale, a packed one's sigma
        itself (its pipeline passes `t / 1000`)."""
        return sigmas if self.packed else timesteps(sigmas, self.config)

    def call(
        self, model: Any, latents: torch.Tensor, t: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """An unpacked transformer's forward (SD3's; Z-Image's takes lists)."""
        return model(hidden_states=latents, timestep=t, **kwargs).sample

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return pack(latents)

    def unpack(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return unpack(packed, height, width)

    def packed_inputs(
        self, kwargs: dict[str, Any], batch: int, height: int, width: int
    ) -> dict[str, Any]:
        """A packed transformer's keyword arguments besides the latents and the timestep (on
        the CPU): the cached text's, Flux's position ids and its guidance value."""
        text_tokens = kwargs["encoder_hidden_states"].shape[1]
        extra = {"img_ids": image_ids(height, width), "txt_ids": torch.zeros(text_tokens, 3)}
        if self.guidance is not None:
            extra["guidance"] = torch.full((batch,), self.guidance)
        return {**extra, **kwargs}

    def reference_inputs(self, extra: dict[str, Any], references: torch.Size) -> dict[str, Any]:
        """An edit family's positions of the target's and the reference tokens, replacing the
        target's alone in `extra` (`references`: batch, count, channels, height, width)."""
        raise NotImplementedError(f"{type(self).__name__} packs no reference latents")
