"""Flow matching (SD3, Flux): sigmas, shift, the noised input and its target checked by hand,
against diffusers' scheduler, and Flux's 2x2 packing round trip."""

from __future__ import annotations

import math

import pytest
import torch

from zerotuner.families import flow_matching as fm


def test_a_hand_computed_example():
    """shift 3 moves u = 0.5 to sigma 3 * 0.5 / (1 + 2 * 0.5) = 0.75; at sigma 0.75 the input
    is 0.25 x + 0.75 n and the target n - x."""
    sigma = fm.shift_sigmas(torch.tensor([0.5]), 3.0)
    assert sigma.item() == pytest.approx(0.75)
    x = torch.tensor([[[[2.0, 0.0]]], [[[4.0, 1.0]]]])  # (2, 1, 1, 2)
    n = torch.tensor([[[[-1.0, 1.0]]], [[[0.0, 0.0]]]])
    noisy, target = fm.noisy_and_target(x, n, torch.tensor([0.75, 0.0]))
    assert noisy.flatten().tolist() == pytest.approx([-0.25, 0.75, 4.0, 1.0])
    assert target.flatten().tolist() == [-3.0, 1.0, -4.0, -1.0]
    config = fm.FlowConfig(shift=3.0)
    assert fm.timesteps(sigma, config).item() == pytest.approx(750.0)


def test_the_shift_is_the_schedulers():
    """FlowMatchEulerDiscreteScheduler's training sigmas are the shifted uniform grid; with
    dynamic shifting (Flux) they are not shifted at train time."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sd3 = FlowMatchEulerDiscreteScheduler(shift=3.0)
    grid = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(sd3.sigmas, fm.shift_sigmas(grid, 3.0).float())
    assert fm.FlowConfig.from_scheduler(sd3.config).shift == 3.0
    flux = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    assert fm.FlowConfig.from_scheduler(flux.config).shift == 1.0


@pytest.mark.parametrize("weighting", ["logit_normal", "uniform", "mode"])
def test_sigmas_follow_the_weighting(weighting):
    gen = torch.Generator().manual_seed(0)
    config = fm.FlowConfig(weighting=weighting, logit_mean=0.5, logit_std=2.0, shift=1.0)
    sigmas = fm.sample_sigmas(4096, config, gen)
    assert sigmas.shape == (4096,) and sigmas.min() >= 0 and sigmas.max() <= 1
    if weighting == "logit_normal":  # sigmoid of N(0.5, 2) from the same generator
        normal = torch.normal(0.5, 2.0, (4096,), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(sigmas, torch.sigmoid(normal))
    elif weighting == "uniform":
        assert sigmas.mean().item() == pytest.approx(0.5, abs=0.02)
    else:  # mode: u -> 1 - u - s (cos^2(pi u / 2) - 1 + u) piles draws in the middle
        u = torch.rand((4096,), generator=torch.Generator().manual_seed(0))
        expected = 1 - u - 1.29 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        torch.testing.assert_close(sigmas, expected)


def test_flux_packing_round_trip_and_position_ids():
    """2x2 patches become tokens of 4 x channels in row-major order (channel-major inside a
    token), and unpacking restores the latents exactly."""
    latents = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6)
    packed = fm.pack(latents)
    assert packed.shape == (2, 2 * 3, 3 * 4)
    # token 1 is the patch at rows 0-1, columns 2-3; its first 4 values are channel 0's
    assert packed[0, 1, :4].tolist() == [2.0, 3.0, 8.0, 9.0]
    torch.testing.assert_close(fm.unpack(packed, 4, 6), latents)
    ids = fm.image_ids(4, 6)
    assert ids.shape == (6, 3)
    assert ids.tolist() == [[0, r, c] for r in range(2) for c in range(3)]


class Echo(torch.nn.Module):
    """A denoiser that predicts its own input and records what it was called with: the loss is
    then the mean of (noisy - target)^2, computable by hand from the same draws."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the objective finds the device
        self.calls: list[dict] = []

    def forward(self, hidden_states, **kwargs):
        from types import SimpleNamespace

        self.calls.append(kwargs)
        return SimpleNamespace(sample=hidden_states)


@pytest.mark.parametrize("packed", [False, True], ids=["sd3", "flux"])
def test_the_loss_is_the_mse_against_the_velocity_target(packed):
    latents = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    config = fm.FlowConfig(shift=3.0)
    objective = fm.FlowObjective(config, packed=packed, guidance=3.5 if packed else None)
    echo = Echo()
    text = {"encoder_hidden_states": torch.zeros(2, 5, 8)}
    loss = objective.loss(
        echo, latents, text, generator=torch.Generator().manual_seed(7), dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(7)  # the same draws, in the objective's order
    noise = torch.randn(latents.shape, generator=gen)
    sigmas = fm.sample_sigmas(2, config, gen)
    s = sigmas.view(2, 1, 1, 1)
    by_hand = (((1 - s) * latents + s * noise) - (noise - latents)).pow(2).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    (call,) = echo.calls
    if packed:  # sigma itself, 2x2 patches of 4 x 6 latents: 6 tokens, ids per patch
        torch.testing.assert_close(call["timestep"], sigmas)
        assert call["img_ids"].shape == (6, 3) and call["txt_ids"].shape == (5, 3)
        assert call["guidance"].tolist() == [3.5, 3.5]
    else:  # SD3: the 0-1000 scale
        torch.testing.assert_close(call["timestep"], sigmas * 1000)
