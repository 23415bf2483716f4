"""Activations in host memory (issue 44, "fitting long clips"): ZT_OFFLOAD_ACTIVATIONS=cpu keeps
each checkpointed block's input off the device. The planner prices it (the blocks' saved inputs
move from the device to the host) and chooses it where it makes a row fit: Wan2.1-T2V-14B's
81-frame clips on one 24 GB GPU, which fit no other way; the gradients are torch's own; the
settings it cannot serve are one line. The Wan full run of tests/test_wan.py trains with it at
ZeRO-3 on 2 ranks."""

from __future__ import annotations

import subprocess

import pytest
import torch
from trainkit import ENTRYPOINT

from zerotuner.errors import EnvironmentUnfit
from zerotuner.families import model_shape
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight import trainable
from zerotuner.preflight.plan import PlanRequest, make_plan
from zerotuner.settings.schema import Settings
from zerotuner.train.model import checkpoint_function
from zerotuner.weights.lora import parse_targets

GPU24 = Hardware("cuda", (GPU(0, "RTX 4090", 24 * GiB, 24 * GiB, (8, 9)),),
                 host_memory=128 * GiB)  # fmt: skip


@pytest.fixture(scope="module")
def wan14b(tmp_path_factory):
    """Wan2.1-T2V-14B's shape and the folder of the configs bench/paper.py writes for it."""
    from bench.paper import config_model

    folder = config_model(tmp_path_factory.mktemp("wan14b"), "wan-14b")
    return model_shape("wan", folder), folder


def _plan(shape, folder=None, **request):
    targets = parse_targets(Settings.model_fields["lora_targets"].default)
    lora = trainable.lora_adapter(shape, rank=16, targets=targets, model_dir=folder)
    return make_plan(
        shape=shape, hardware=GPU24, offload_disk_free=2 * 10**12, training=lora,
        request=PlanRequest(resolution=632, micro_batch=1, world_size=1, frames=81,
                            mixed_precision="bf16", **request),
    )  # fmt: skip


def test_the_plan_moves_a_clips_checkpointed_activations_to_the_host_to_fit(wan14b) -> None:
    shape, folder = wan14b
    plan = _plan(shape, folder)
    choice = plan.choice
    assert choice.offload_activations == "cpu" and choice.gradient_checkpointing
    assert choice.label().endswith("checkpointing, activations->cpu")
    assert any("host memory are what makes it fit" in reason for reason in plan.reasons)
    # the same option on the device: the blocks' inputs are the whole difference
    same = plan.rows[[r.choice() for r in plan.rows].index(
        {**choice.choice(), "offload_activations": "none"})]  # fmt: skip
    inputs = shape.video.saved_inputs(shape.video.tokens(81, 632))  # bf16: as counted
    on_device = "device.activations"
    assert same.parts[on_device] - choice.parts[on_device] == inputs
    assert choice.parts["host_per_rank.activation_checkpoints"] == inputs
    assert choice.host_bytes - same.host_bytes == inputs
    assert not same.fits and choice.fits
    # asked to keep them on the device, nothing fits (exit 3)
    with pytest.raises(EnvironmentUnfit, match="nothing fits"):
        _plan(shape, folder, offload_activations="none")
    # where the device holds them, the plan keeps them there
    wan = model_shape("wan")
    assert _plan(wan).choice.offload_activations == "none"
    assert {r.offload_activations for r in _plan(wan).rows} == {"none", "cpu"}


def test_gradients_are_the_same_with_the_inputs_in_host_memory(family_demo_dir) -> None:
    from diffusers import WanTransformer3DModel

    grads = []
    for how in ("none", "cpu"):
        model = WanTransformer3DModel.from_pretrained(
            family_demo_dir("wan") / "model", subfolder="transformer"
        )
        model.enable_gradient_checkpointing(checkpoint_function(how))
        model.train()
        c, gen = model.config, torch.Generator().manual_seed(1)
        clip = torch.randn(1, c.in_channels, 3, 8, 8, generator=gen)
        text = torch.randn(1, 7, c.text_dim, generator=gen)
        out = model(hidden_states=clip, timestep=torch.tensor([500]),
                    encoder_hidden_states=text).sample  # fmt: skip
        out.square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(g is not None for g in grads[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_what_it_cannot_serve_is_one_line(demo_dir, family_demo_dir, tmp_path) -> None:
    base = {"ZT_DATA_DIR": str(demo_dir / "data"), "ZT_OUTPUT_DIR": str(tmp_path / "out"),
            "ZT_CACHE_DIR": str(tmp_path / "cache"), "ZT_OFFLOAD_DIR": str(tmp_path / "off"),
            "ZT_DEVICE": "cpu", "ZT_METRICS_PORT": "0", "ZT_OFFLOAD_ACTIVATIONS": "cpu",
            "PATH": "/usr/bin:/bin"}  # fmt: skip
    cases = [
        ({"ZT_MODEL": str(demo_dir / "model")}, "sdxl's activations are not counted per block"),
        ({"ZT_MODEL": str(family_demo_dir("wan") / "model"),
          "ZT_GRADIENT_CHECKPOINTING": "false"}, "only checkpointed activations"),
    ]  # fmt: skip
    for extra, why in cases:
        done = subprocess.run([ENTRYPOINT, "check"], env={**base, **extra},
                              capture_output=True, text=True)  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 2 and "Traceback" not in out, out[-2000:]
        (line,) = [x for x in out.splitlines() if why in x and "FAIL" in x]
        assert "ZT_OFFLOAD_ACTIVATIONS=cpu" in line
