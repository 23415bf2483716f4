"""LoRA (ZT_TRAINING_TYPE=lora): settings, the adapter file, and 2-rank DeepSpeed runs on the
tiny demo SDXL with the base frozen (real torchrun, real DeepSpeed, real peft)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file, save_file

from zerotuner import lora
from zerotuner.checkpoint import read_manifest
from zerotuner.commands import config as _config  # noqa: F401 (imported before any patch)
from zerotuner.errors import ConfigError
from zerotuner.settings import Settings

# --- the adapter file ---------------------------------------------------------------------
TARGETS = "attention+ff,proj_in,proj_out,conv1,conv2,conv_in,conv_out,time_emb_proj"
RANK, ALPHA = 4, 2  # alpha != rank: only the metadata carries it into diffusers


def lora_settings(**extra) -> Settings:
    values = dict(training_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS)
    return Settings(**(values | extra))


def unet_inputs(unet, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    config = unet.config
    sample = torch.randn(1, config.in_channels, 8, 8, generator=gen)
    states = torch.randn(1, 77, config.cross_attention_dim, generator=gen)
    added = {
        "text_embeds": torch.randn(1, config.projection_class_embeddings_input_dim - 6 *
                                   config.addition_time_embed_dim, generator=gen),
        "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]),
    }  # fmt: skip
    return sample, torch.tensor([10]), states, added


@torch.no_grad()
def unet_output(unet, seed: int = 0) -> torch.Tensor:
    sample, t, states, added = unet_inputs(unet, seed)
    return unet.eval()(sample, t, states, added_cond_kwargs=added).sample


def plain_pipeline(demo_dir: Path):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(demo_dir / "model")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_an_adapter_written_loads_in_diffusers_with_its_alpha(demo_dir, tmp_path):
    """The file reproduces the trained UNet's output in a plain pipeline, conv layers and
    alpha != rank included."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    settings = lora_settings()
    lora.add_adapter(unet, settings)
    gen = torch.Generator().manual_seed(1)
    for name, param in unet.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapter an effect
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    out = lora.write_adapter(
        "sdxl", state, lora.shapes(unet), lora.metadata(lora.lora_config(settings)), tmp_path
    )
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(out)
    loaded = unet_output(pipe.unet)
    expected = unet_output(unet)
    assert not torch.allclose(loaded, base, atol=1e-3)
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    # the kohya copy, converted by diffusers' own loader: the same UNet, the true alpha
    assert {float(t) for k, t in load_file(out / lora.KOHYA_FILE).items() if "alpha" in k} == {
        ALPHA
    }
    pipe = plain_pipeline(demo_dir)
    pipe.load_lora_weights(out, weight_name=lora.KOHYA_FILE)
    torch.testing.assert_close(unet_output(pipe.unet), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "state",
    [
        {},  # what a gather that never happened leaves
        {"placeholder": torch.empty(0)},  # ZeRO-3's shape-[0] stand-ins
    ],
)
def test_an_empty_or_partitioned_adapter_is_refused(demo_dir, tmp_path, state):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    lora.add_adapter(unet, lora_settings())
    expected = lora.shapes(unet)
    if state:  # every adapter tensor present, each an empty placeholder
        state = {name: torch.empty(0) for name in expected}
    with pytest.raises(RuntimeError, match="refusing to write"):
        lora.write_adapter("sdxl", state, expected, {}, tmp_path / "final")
    assert not (tmp_path / "final").exists()
    partial = {name: torch.zeros(shape) for name, shape in list(expected.items())[:-1]}
    with pytest.raises(RuntimeError, match="partial"):
        lora.write_adapter("sdxl", partial, expected, {}, tmp_path / "final")
    assert not (tmp_path / "final").exists()


# --- 2-rank DeepSpeed runs ------------------------------------------------------------------
STEPS = 16  # the ZeRO-3 run: enough for the loss to fall visibly
SHORT = 3  # the other stages: train, checkpoint at 2, export
LR = 1e-2  # LoRA takes a larger rate than full training (diffusers' examples: 1e-4 vs 1e-5)
PROMPT = "a red circle on a white background"
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def lora_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-feature-cache")


def train(tmp: Path, demo: Path, cache: Path, *, stage: int, steps: int, **settings):
    output = settings.pop("output", tmp / "output")
    offload = {k: settings.pop(k) for k in ("offload_optimizer", "offload_param") if k in settings}
    config = tk.ds_config(stage, steps=steps, lr=LR, nvme_dir=tmp / "nvme", **offload)
    job = tk.write_job(tmp / "job.json", model=demo / "model", deepspeed=config)
    values = dict(training_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS)
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, validation_inference_steps=2, **(values | settings),
    )  # fmt: skip
    return tk.run_ranks(tmp, env, job_file=job), output


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, demo_dir: Path, lora_cache: Path):
    tmp = tmp_path_factory.mktemp("lora-zero3")
    proc, output = train(
        tmp, demo_dir, lora_cache, stage=3, steps=STEPS, checkpoint_every_steps=8,
        validation_prompts=[PROMPT],
    )  # fmt: skip
    tk.assert_ok(proc, tmp)
    return output, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def zero3(zero3_run) -> Path:
    return zero3_run[0]


def held_out_loss(pipe, demo_dir: Path, *, images: int = 32, draws: int = 4) -> float:
    """The training loss (zerotuner.loop's) of `pipe`'s UNet on demo images with fixed noise
    and timesteps, averaged over `draws` seeds."""
    from diffusers import DDPMScheduler

    from zerotuner import data, loop, model

    source = demo_dir / "model"
    scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")
    items = data.scan(demo_dir / "data", log_skipped=False).items[:images]
    examples = [data.load_example(item, (64, 64), flip=False) for item in items]
    pixels = torch.stack([torch.from_numpy(e.pixels) for e in examples])
    parts = model.Components(
        family="sdxl", source=source, unet=None, scheduler=scheduler, vae=pipe.vae,
        text_encoders=[pipe.text_encoder, pipe.text_encoder_2],
        tokenizers=[pipe.tokenizer, pipe.tokenizer_2],
    )  # fmt: skip
    conditioning = model.CONDITIONING["sdxl"]
    batch = {
        **conditioning.encode_text(parts, [item.caption for item in items]),
        "time_ids": torch.stack(
            [model.time_ids(e.original_size, e.crop_top_left, e.target_size) for e in examples]
        ),
    }
    latents = model.encode_images(pipe.vae, pixels)
    kwargs = conditioning.unet_kwargs(batch, torch.float32)
    config = loop.LossConfig(model.prediction_type(scheduler), None, 0.0)
    with torch.no_grad():
        losses = [
            loop.diffusion_loss(
                pipe.unet, scheduler, latents, kwargs, config=config,
                generator=torch.Generator().manual_seed(draw), dtype=torch.float32,
            )
            for draw in range(draws)
        ]  # fmt: skip
    return float(sum(losses)) / draws


def checkpoint_parts(path: Path) -> tuple[dict, dict]:
    """A LoRA checkpoint consolidated (zero_to_fp32): (base weights under the base UNet's
    names, adapter weights under the adapter file's names)."""
    from zerotuner.export import checkpoint_unet_state

    state = checkpoint_unet_state(path)
    base = {k.replace(".base_layer", ""): v for k, v in state.items() if ".lora_" not in k}
    adapter = {f"unet.{k}": v for k, v in lora.peft_keys(state).items() if ".lora_" in k}
    return base, adapter


def assert_only_the_adapter_trained(output: Path, demo_dir: Path, step: int) -> dict:
    base, adapter = checkpoint_parts(output / "checkpoints" / f"step-{step}")
    saved = load_file(demo_dir / "model" / UNET_FILE)
    assert base.keys() == saved.keys()
    for key in saved:  # bitwise: the base never reached the optimizer
        assert torch.equal(base[key], saved[key]), key
    final = load_file(output / "final" / lora.ADAPTER_FILE)
    assert final.keys() == adapter.keys() and len(final) > 0
    for key, tensor in final.items():
        assert tensor.numel() > 0 and torch.equal(tensor, adapter[key]), key
    ups = [t for k, t in final.items() if ".lora_B." in k]
    assert ups and all(t.abs().sum() > 0 for t in ups), "an adapter layer did not train"
    return final


@pytest.mark.slow
def test_zero3_lora_trains_only_the_adapter(zero3, zero3_run, demo_dir: Path) -> None:
    assert len(tk.read_steps(zero3)) == STEPS
    # the per-step loss is too noisy over 16 steps (random timesteps): the same noise and
    # timesteps on the same images, before and after
    pipe = plain_pipeline(demo_dir)
    before = held_out_loss(pipe, demo_dir)
    pipe.load_lora_weights(zero3 / "final")
    assert held_out_loss(pipe, demo_dir) < 0.95 * before
    assert_only_the_adapter_trained(zero3, demo_dir, STEPS)
    log = zero3_run[1]  # DeepSpeed's per-step warning and diffusers' text-encoder notice
    assert "LoRA rank 4, alpha 2 on " in log and "samples: 1 image(s)" in log
    for notice in ("reduce_scatter_tensor", "No LoRA keys associated"):
        assert notice not in log, notice
    manifest = read_manifest(zero3 / "checkpoints" / "step-8")
    assert manifest["training_type"] == "lora" and manifest["zero_stage"] == 3
    assert manifest["lora"]["rank"] == RANK and manifest["lora"]["alpha"] == ALPHA


@pytest.mark.slow
def test_zero3_adapter_loads_in_a_plain_pipeline_and_changes_it(zero3, demo_dir: Path) -> None:
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    with safe_open(str(zero3 / "final" / lora.ADAPTER_FILE), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (meta["unet.r"], meta["unet.lora_alpha"]) == (RANK, ALPHA)
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(zero3 / "final")
    layers = [m for m in pipe.unet.modules() if isinstance(m, LoraLayer)]
    assert layers and all(v == ALPHA / RANK for m in layers for v in m.scaling.values())
    loaded = unet_output(pipe.unet)
    assert not torch.allclose(loaded, base, atol=1e-4)
    kohya = plain_pipeline(demo_dir)
    kohya.load_lora_weights(zero3 / "final", weight_name=lora.KOHYA_FILE)
    torch.testing.assert_close(unet_output(kohya.unet), loaded, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_zero3_validation_samples_use_the_adapter(zero3, demo_dir: Path, tmp_path) -> None:
    """The run's sample differs from the base pipeline's at the same prompt and seed."""
    import numpy as np
    from PIL import Image

    from zerotuner import samples

    (made,) = sorted((zero3 / "samples" / f"step-{STEPS}").glob("*.png"))
    (base,) = samples.render(
        demo_dir / "model",
        None,
        [PROMPT],
        tmp_path / "base",
        resolution=64,
        inference_steps=2,
        seed=42,
        compare=False,
    )
    with_adapter = samples.render(
        demo_dir / "model", None, [PROMPT], tmp_path / "again", resolution=64, inference_steps=2,
        seed=42, lora_dir=zero3 / "final", compare=False,
    )[0]  # fmt: skip
    pixels = [np.asarray(Image.open(p), dtype=np.int16) for p in (made, base, with_adapter)]
    # The rank rendered with its own thread count: float sums may round a pixel differently.
    assert np.abs(pixels[0] - pixels[1]).mean() > 10
    assert np.abs(pixels[0] - pixels[2]).max() <= 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        {"stage": 0},
        {"stage": 2},
        {"stage": 2, "offload_optimizer": "cpu"},
        {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
    ],
    ids=["zero0", "zero2", "zero2-cpu-offload", "zero3-nvme"],
)
def test_lora_at_other_stages(offload, tmp_path, demo_dir: Path, lora_cache: Path) -> None:
    proc, output = train(
        tmp_path, demo_dir, lora_cache, steps=SHORT, checkpoint_every_steps=2, **offload
    )
    tk.assert_ok(proc, tmp_path)
    assert_only_the_adapter_trained(output, demo_dir, SHORT)


@pytest.mark.slow
def test_zero3_lora_resumes_at_the_next_step(zero3, tmp_path, demo_dir, lora_cache) -> None:
    """Restarted from its step-8 checkpoint, the run ends where the uninterrupted one did."""
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(zero3 / "checkpoints" / "step-8", stopped / "checkpoints" / "step-8")
    (stopped / "checkpoints" / "latest").write_text("step-8")
    proc, output = train(
        tmp_path, demo_dir, lora_cache, stage=3, steps=STEPS, checkpoint_every_steps=8,
        output=stopped,
    )  # fmt: skip
    tk.assert_ok(proc, tmp_path)
    assert "resumed from" in proc.stderr + proc.stdout
    steps, expected = tk.read_steps(output), tk.read_steps(zero3)
    assert [s["step"] for s in steps] == list(range(9, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in expected[8:]]
    resumed = load_file(output / "final" / lora.ADAPTER_FILE)
    uninterrupted = load_file(zero3 / "final" / lora.ADAPTER_FILE)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"training_type": "full"},
            "ZT_TRAINING_TYPE=full: the checkpoint to resume ({path}) is from a lora run; set "
            "ZT_TRAINING_TYPE=lora to continue it, or set ZT_RESUME=never or another "
            "ZT_OUTPUT_DIR to start afresh",
        ),
        (
            {"lora_rank": 8},
            "ZT_LORA_RANK=8: the checkpoint to resume ({path}) has an adapter with rank 4; set "
            "it back to continue, or set ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh",
        ),
        (
            {"lora_targets": "attention"},
            "ZT_LORA_TARGETS=attention: the checkpoint to resume ({path}) has an adapter with "
            "targets to_k,to_q,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out,conv1,"
            "conv2,conv_in,conv_out,time_emb_proj; set it back to continue, or set "
            "ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh",
        ),
    ],
)
def test_a_lora_checkpoint_resumes_only_as_the_same_lora(zero3, settings, expected) -> None:
    path = zero3 / "checkpoints" / "step-8"
    values = {"training_type": "lora", "lora_rank": RANK, "lora_targets": TARGETS} | settings
    if values["training_type"] == "full":
        values = {"training_type": "full"}
    with pytest.raises(ConfigError) as caught:
        lora.check_resume(read_manifest(path), Settings(**values), path)
    assert caught.value.problems == [expected.format(path=path)]
    lora.check_resume(read_manifest(path), lora_settings(lora_alpha=8), path)  # alpha may change


def test_a_full_checkpoint_is_not_resumed_as_lora(tmp_path) -> None:
    manifest = {"step": 4, "zero_stage": 2}  # written before LoRA existed: a full run's
    with pytest.raises(ConfigError, match="is from a full run; set ZT_TRAINING_TYPE=full"):
        lora.check_resume(manifest, lora_settings(), tmp_path)
    lora.check_resume({"training_type": "full"}, Settings(), tmp_path)


@pytest.mark.slow
def test_export_writes_the_adapter_of_a_lora_checkpoint(zero3, tmp_path) -> None:
    """`zerotuner export CKPT OUT` on a ZeRO-3 LoRA checkpoint: the run's own adapter file."""
    from zerotuner.export import export_checkpoint

    out = export_checkpoint(zero3 / "checkpoints" / f"step-{STEPS}", tmp_path / "exported")
    exported = load_file(out / lora.ADAPTER_FILE)
    final = load_file(zero3 / "final" / lora.ADAPTER_FILE)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert (out / lora.KOHYA_FILE).is_file()
    with pytest.raises(ConfigError, match="has no EMA weights"):
        export_checkpoint(zero3 / "checkpoints" / f"step-{STEPS}", tmp_path / "ema", ema=True)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(2, 2), (3, 1)])
def test_zero3_lora_resumes_on_another_stage_or_world_size(
    zero3, tmp_path, demo_dir, lora_cache, stage, world
) -> None:
    """Through the universal checkpoint: on 2 ranks at ZeRO-2 the same samples are seen, so
    the losses match the uninterrupted run's; on 1 rank a run that ends at the checkpoint's
    own step exports exactly the checkpoint's adapter (it was loaded, not trained afresh)."""
    last = 12 if world == 2 else 8
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(zero3 / "checkpoints" / "step-8", stopped / "checkpoints" / "step-8")
    config = tk.ds_config(stage, world=world, steps=last, lr=LR)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config,
                       world=world)  # fmt: skip
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=stopped, cache=lora_cache,
        max_steps=last, training_type="lora", lora_rank=RANK, lora_alpha=ALPHA,
        lora_targets=TARGETS, checkpoint_every_steps=0,
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job, world=world)
    tk.assert_ok(proc, tmp_path, world=world)
    assert "converting once to universal" in proc.stdout + proc.stderr
    final = load_file(stopped / "final" / lora.ADAPTER_FILE)
    if world == 2:
        losses = [s["loss"] for s in tk.read_steps(stopped)]
        before = [s["loss"] for s in tk.read_steps(zero3)]
        assert losses == pytest.approx(before[8:12], abs=1e-3)
    else:
        _, saved = checkpoint_parts(zero3 / "checkpoints" / "step-8")
        assert final.keys() == saved.keys()
        assert all(torch.equal(final[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_a_lora_checkpoint_resumes_only_onto_its_base(zero3, demo_dir, tmp_path) -> None:
    path = zero3 / "checkpoints" / "step-8"
    manifest = read_manifest(path)
    own = lora.base_digest(demo_dir / "model")
    assert manifest["lora"]["base_unet_sha256"] == own
    lora.check_resume_base(manifest, own, lora_settings(), path)
    other = tmp_path / "model"
    shutil.copytree(demo_dir / "model" / "unet", other / "unet")
    weights = load_file(other / UNET_FILE)
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3  # one tensor fine-tuned a little
    save_file(weights, other / UNET_FILE)
    settings = lora_settings(model=str(other))
    with pytest.raises(ConfigError) as caught:
        lora.check_resume_base(manifest, lora.base_digest(other), settings, path)
    assert caught.value.problems[0].startswith(
        f"ZT_MODEL={other}: its UNet weights differ from those the checkpoint to resume "
        f"({path}) trained its adapter on"
    )
