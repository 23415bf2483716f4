"""Shared by the LoRA tests: settings, a plain pipeline and UNet probe, the 2-rank DeepSpeed
run of the tiny demo SDXL with LoRA, and the checks of what a LoRA checkpoint holds.

A pytest plugin (`pytest_plugins = ["lorakit"]` in a test module), so that its session
fixtures, the ZeRO-3 run above all, are made once for every LoRA test file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

from zerotuner.settings.schema import Settings
from zerotuner.weights import lora_files
from zerotuner.weights.checkpoint import read_manifest

TARGETS = "attention+ff,proj_in,proj_out,conv1,conv2,conv_in,conv_out,time_emb_proj"
RANK, ALPHA = 4, 2  # alpha != rank: only the metadata carries it into diffusers
# The shared ZeRO-3 run trains the text encoders' adapters too (the hardest case: DeepSpeed
# partitions them with the UNet); every run resumed from its checkpoints says so as well.
TEXT = {"lora_text_encoder": True}


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


STEPS = 16  # the ZeRO-3 run: enough for the loss to fall visibly
SHORT = 3  # the other stages: train, checkpoint at 2, export
LR = 1e-2  # LoRA takes a larger rate than full training (diffusers' examples: 1e-4 vs 1e-5)
PROMPT = "a red circle on a white background"
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="session")
def lora_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-feature-cache")


def train(tmp: Path, demo: Path, cache: Path, *, stage: int, steps: int, **settings):
    """A LoRA run of the demo on 2 CPU ranks; `settings` become ZT_* variables, except the
    Job's: offload targets, `precision` (bf16: DeepSpeed keeps the base in bf16) and
    `gradient_checkpointing`."""
    output = settings.pop("output", tmp / "output")
    offload = {k: settings.pop(k) for k in ("offload_optimizer", "offload_param") if k in settings}
    precision = settings.pop("precision", "no")
    config = tk.ds_config(
        stage, steps=steps, lr=LR, nvme_dir=tmp / "nvme", precision=precision, **offload
    )
    job = tk.write_job(
        tmp / "job.json", model=demo / "model", deepspeed=config, mixed_precision=precision,
        gradient_checkpointing=settings.pop("gradient_checkpointing", False),
    )  # fmt: skip
    values = dict(training_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS)
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, validation_inference_steps=2, **(values | settings),
    )  # fmt: skip
    return tk.run_ranks(tmp, env, job_file=job), output


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory, demo_dir: Path, lora_cache: Path):
    tmp = tmp_path_factory.mktemp("lora-zero3")
    proc, output = train(
        tmp, demo_dir, lora_cache, stage=3, steps=STEPS, checkpoint_every_steps=8,
        validation_prompts=[PROMPT], ema=True, lora_merge=True, **TEXT,
    )  # fmt: skip
    tk.assert_ok(proc, tmp)
    return output, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def zero3(zero3_run) -> Path:
    return zero3_run[0]


def held_out_loss(pipe, demo_dir: Path, *, images: int = 32, draws: int = 4) -> float:
    """The training loss (zerotuner.train.loop's) of `pipe`'s UNet on demo images with fixed noise
    and timesteps, averaged over `draws` seeds."""
    from diffusers import DDPMScheduler

    from zerotuner.data.loading import load_example
    from zerotuner.data.scan import scan
    from zerotuner.families import ddpm, get
    from zerotuner.families.unet import time_ids
    from zerotuner.train import model

    source = demo_dir / "model"
    scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler")
    items = scan(demo_dir / "data", log_skipped=False).items[:images]
    examples = [load_example(item, (64, 64), flip=False) for item in items]
    pixels = torch.stack([torch.from_numpy(e.pixels) for e in examples])
    parts = model.Components(
        family="sdxl", source=source, denoiser=None, scheduler=scheduler, vae=pipe.vae,
        text_encoders=[pipe.text_encoder, pipe.text_encoder_2],
        tokenizers=[pipe.tokenizer, pipe.tokenizer_2],
    )  # fmt: skip
    conditioning = get("sdxl")
    batch = {
        **conditioning.encode_text(parts, [item.caption for item in items]),
        "time_ids": torch.stack(
            [time_ids(e.original_size, e.crop_top_left, e.target_size) for e in examples]
        ),
    }
    latents = conditioning.encode_latents(pipe.vae, pixels)
    kwargs = conditioning.model_kwargs(batch, torch.float32)
    config = ddpm.LossConfig(ddpm.prediction_type(scheduler), None, 0.0)
    with torch.no_grad():
        losses = [
            ddpm.diffusion_loss(
                pipe.unet, scheduler, latents, kwargs, config=config,
                generator=torch.Generator().manual_seed(draw), dtype=torch.float32,
            )
            for draw in range(draws)
        ]  # fmt: skip
    return float(sum(losses)) / draws


def checkpoint_adapter(path: Path) -> dict:
    """A LoRA checkpoint consolidated (zero_to_fp32 or the ZeRO-0 module state), under the
    adapter file's names; it holds the adapter only (the frozen base is left out)."""
    from zerotuner.weights.export import checkpoint_unet_state

    state = checkpoint_unet_state(path)
    assert state and all(".lora_" in k for k in state), [k for k in state if ".lora_" not in k]
    return file_names(state)


def file_names(state: dict) -> dict:
    """Module parameter names to the adapter file's (part prefix + peft keys)."""
    parts = lora_files.by_part(lora_files.peft_keys(state))
    return {f"{part}.{k}": v for part, layers in parts.items() for k, v in layers.items()}


def checkpoint_bytes(path: Path) -> int:
    return sum(read_manifest(path)["files"].values())


def assert_only_the_adapter_trained(output: Path, demo_dir: Path, step: int) -> dict:
    """The checkpoint holds the adapter alone (the optimizer's parameters are DeepSpeed's
    param_shapes, which zero_to_fp32 rebuilds: no base weight among them), and so is smaller
    than the base UNet's own fp32 file, let alone a full run's checkpoint (that file's weights
    again as fp32 masters, plus two Adam moments). That the base itself never moves is shown by
    the resumes: a run reloaded from the model files continues bit for bit."""
    path = output / "checkpoints" / f"step-{step}"
    adapter = checkpoint_adapter(path)
    assert checkpoint_bytes(path) < (demo_dir / "model" / UNET_FILE).stat().st_size
    final = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert final.keys() == adapter.keys() and len(final) > 0
    for key, tensor in final.items():
        assert tensor.numel() > 0 and torch.equal(tensor, adapter[key]), key
    assert all(t.dtype == torch.float32 for t in final.values())  # the masters, at any precision
    ups = {k: t for k, t in final.items() if ".lora_B." in k}
    still = [k for k, t in ups.items() if t.abs().sum() == 0]
    # SDXL reads the first text encoder's penultimate layer: its last layer gets no gradient
    unused = "text_encoder.encoder.layers.1."  # the demo's CLIP-L has 2 layers
    assert ups and all(k.startswith(unused) for k in still), f"not trained: {still[:3]}"
    return final


def perturb_adapter(module: torch.nn.Module, scale: float) -> None:
    """Give a fresh adapter something to say (peft starts lora_B at zero): lora_B drawn at
    `scale`, DoRA's magnitudes moved by up to ~20 %, from a fixed seed."""
    gen = torch.Generator().manual_seed(1)
    for name, param in module.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=gen) * scale)
        if "lora_magnitude_vector" in name:
            param.data.mul_(1 + 0.2 * torch.randn(param.shape, generator=gen))
