"""speed.prepare: compiled blocks train the tiny demo UNet to the same losses as eager, keep
every state_dict key, and build a bounded number of graphs across bucket shapes; ZT_COMPILE's
rule and its refusals; the light commands' start-up imports."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.families.ddpm import LossConfig, diffusion_loss
from zerotuner.settings.schema import Settings
from zerotuner.train import speed
from zerotuner.train.loop import step_generator

# Latent shapes of two buckets, then the first again: each block compiles once per bucket, and
# coming back to a bucket reuses its graphs.
SHAPES = ((8, 8), (16, 8), (8, 8))
CONFIG = LossConfig(prediction_type="epsilon", snr_gamma=None, noise_offset=0.0)


def _kwargs(unet, batch: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    c = unet.config
    pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    return {
        "encoder_hidden_states": torch.randn(batch, 77, c.cross_attention_dim, generator=gen),
        "added_cond_kwargs": {
            "text_embeds": torch.randn(batch, pooled, generator=gen),
            "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * batch),
        },
    }


def _step(unet, scheduler, step: int, shape: tuple[int, int]) -> torch.Tensor:
    """The loop's loss for one micro-batch of 2 (the loop's own draws), then backward."""
    gen = step_generator(0, step, 0, 0)
    latents = torch.randn((2, 4, *shape), generator=gen)
    loss = diffusion_loss(unet, scheduler, latents, _kwargs(unet, 2), config=CONFIG,
                          generator=gen, dtype=torch.float32)  # fmt: skip
    loss.backward()
    return loss.detach()


def _train(unet, scheduler, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW steps on one bucket: the losses, and the gradients of the first step."""
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    unet.train()
    losses, grads = [], {}
    for step in range(1, steps + 1):
        losses.append(_step(unet, scheduler, step, SHAPES[0]).item())
        if step == 1:
            grads = {n: p.grad.clone() for n, p in unet.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.fixture(scope="module")
def unet_and_scheduler(demo_dir):
    model = demo_dir / "model"
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    return unet, DDPMScheduler.from_pretrained(model, subfolder="scheduler")


@pytest.fixture(scope="module")
def trained(unet_and_scheduler):
    """The demo UNet trained eager and with its blocks compiled, same draws. The backend is
    aot_eager (dynamo's graphs and AOTAutograd's joint forward/backward, kernels left to
    eager): inductor's C++ codegen takes minutes on a cold cache, a fresh CI machine's; the
    bench's speed suite trains with inductor itself (losses within 1e-6 of eager)."""
    unet, scheduler = unet_and_scheduler
    eager, compiled = copy.deepcopy(unet), copy.deepcopy(unet)
    keys = list(compiled.state_dict())
    prepared = speed.prepare(compiled, Settings(compile=True), accelerator="cpu", zero_stage=2,
                             backend="aot_eager")  # fmt: skip
    eager_losses, eager_grads = _train(eager, scheduler)
    compiled_losses, compiled_grads = _train(compiled, scheduler)
    return {
        "eager": eager, "compiled": compiled, "keys": keys, "prepared": prepared,
        "eager_losses": eager_losses, "compiled_losses": compiled_losses,
        "eager_grads": eager_grads, "compiled_grads": compiled_grads,
    }  # fmt: skip


def test_compiled_losses_match_eager(trained):
    assert trained["prepared"].compiled_blocks == len(speed.blocks(trained["compiled"])) == 5
    torch.testing.assert_close(
        trained["compiled_losses"], trained["eager_losses"], rtol=1e-4, atol=1e-6
    )
    eager = trained["eager_grads"]
    for name, grad in trained["compiled_grads"].items():
        torch.testing.assert_close(grad, eager[name], rtol=1e-3, atol=1e-6, msg=name)


def test_block_compile_keeps_state_dict_keys(trained):
    state = trained["compiled"].state_dict()
    assert list(state) == trained["keys"] == list(trained["eager"].state_dict())
    assert not [k for k in state if "_orig_mod" in k]


def test_graphs_stay_bounded_across_buckets(unet_and_scheduler):
    """Dynamo's graphs per bucket (aot_eager: the same graphs, no kernel compile to wait for)."""
    unet, scheduler = unet_and_scheduler
    unet = copy.deepcopy(unet)
    prepared = speed.prepare(unet, Settings(compile=True), accelerator="cpu", zero_stage=0,
                             shapes=2, backend="aot_eager")  # fmt: skip
    blocks = prepared.compiled_blocks
    before, built = speed.graphs_built(), []
    for step, shape in enumerate(SHAPES, start=1):
        _step(unet, scheduler, step, shape)
        built.append(speed.graphs_built() - before)
    assert built[0] == blocks  # one graph per block: no graph breaks inside a block
    assert built[1] == 2 * blocks  # one more per block for the second bucket
    assert built[2] == built[1]  # back to the first bucket: nothing recompiled


def test_auto_rule_and_refusals(tmp_path, monkeypatch):
    assert not speed.decide("auto", accelerator="cpu", zero_stage=2).compile
    assert not speed.decide("auto", accelerator="cuda", zero_stage=0).compile
    assert speed.decide(True, accelerator="cpu", zero_stage=0).compile
    assert not speed.decide("auto", accelerator="cuda", zero_stage=3).compile
    with pytest.raises(ConfigError, match="ZT_COMPILE=true does not work with ZeRO-3") as e:
        speed.notes(Settings(compile=True), accelerator="cpu", zero_stage=3)
    assert e.value.exit_code == 2
    (note,) = speed.notes(Settings(), accelerator="cpu", zero_stage=2)
    assert "no torch.compile: off (auto)" in note.message
    monkeypatch.setenv("PATH", str(tmp_path))  # no C++ compiler to be found
    with pytest.raises(EnvironmentUnfit, match="ZT_COMPILE=true needs a C\\+\\+ compiler") as e:
        speed.notes(Settings(compile=True), accelerator="cpu", zero_stage=2)
    assert e.value.exit_code == 3
    assert speed.notes(Settings(compile=False), accelerator="cpu", zero_stage=2)


def test_light_commands_import_no_heavy_framework():
    """The CLI and the commands that need no model import neither torch, diffusers nor
    DeepSpeed (seconds of start-up each); `train` imports what its probe and plan use."""
    light = ("cli", "commands.check", "commands.demo", "commands.export", "commands.builder",
             "commands.what_if")  # fmt: skip
    code = "; ".join(f"import zerotuner.{m}" for m in light) + (
        "; import sys; print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'diffusers', 'deepspeed', 'transformers', 'peft'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("setting", "user_value", "set_here"),
    [("auto", None, True), (True, None, False), ("auto", "0", False)],
)
def test_compiling_off_keeps_the_libraries_eager(setting, user_value, set_here):
    """A rank with compiling off sets TORCHDYNAMO_DISABLE before the libraries import: the
    torch.compile that bitsandbytes wraps its CPU kernels in at import hands them back as they
    are. ZT_COMPILE=true, or the user's own TORCHDYNAMO_DISABLE, leaves torch.compile alone."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    if user_value is not None:
        env["TORCHDYNAMO_DISABLE"] = user_value
    code = (
        f"from zerotuner.train import speed; print(speed.keep_libraries_eager({setting!r})); "
        "import torch, bitsandbytes; f = lambda x: x + 1; print(torch.compile(f) is f)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.split() == [str(set_here), str(set_here)]


def test_cpu_info_is_asked_once_per_cpu_model(tmp_path):
    """py-cpuinfo's answer (a subprocess, about 1 s of CPU per rank) is kept beside the built
    ops: a later rank on this CPU reads it; a torn file is asked again and rewritten."""
    asked: list[int] = []

    def ask() -> dict:
        asked.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "fma"]}

    assert speed._kept(ask, tmp_path / "ops")() == ask() and len(asked) == 2
    assert speed._kept(ask, tmp_path / "ops")() == {"arch": "X86_64", "flags": ["avx2", "fma"]}
    assert len(asked) == 2  # read, not asked
    (kept,) = (tmp_path / "ops").glob("cpuinfo-*.json")
    kept.write_text('{"arch": ')
    assert speed._kept(ask, tmp_path / "ops")()["arch"] == "X86_64" and len(asked) == 3
    assert json.loads(kept.read_text())["flags"] == ["avx2", "fma"]
    assert [p.name for p in (tmp_path / "ops").iterdir()] == [kept.name]  # no part file left
