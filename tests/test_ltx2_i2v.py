"""LTX-2 image-to-video (`ltx2i2v`, issue 47): the tiny demo (ltx2's parts saved as an
LTX2ImageToVideoPipeline) renders a clip from an image and is told apart by its files; an LTX-2
checkpoint (an LTX2Pipeline folder, a hub id) reads as `ltx2` and trains image-to-video when
ZT_MODEL_FAMILY says so (LTX-2's other pipelines are refused in tests/test_ltx2.py). The
objective is the pipeline's: the clip's own first latent frame (equal to the input image's
latents: the VAE is causal) kept clean, its tokens at timestep 0, the loss on the later frames.
On 2 CPU ranks at ZeRO-3 it trains in full (the clips' loss falls, validation clips from an input
image, export as LTX2ImageToVideoPipeline, resume on one rank at ZeRO-2) and as a LoRA whose
adapter loads with LTX2ImageToVideoPipeline.load_lora_weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from test_flow_training import (
    PROMPT,
    STEPS,
    TOKENS,
    mean_loss,
    pipeline_parts,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)
from test_wan_i2v import first_frame

from zerotuner import families
from zerotuner.data import clips
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings

FAMILY = "ltx2i2v"
CLIP_BUCKET = (64, 64, 9)  # the demo's clips: 9 frames of 64 x 64 (its VAE folds 2 into 1)
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
LORA = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2}  # fmt: skip
I2V_OBJECTIVE = "the first latent frame kept clean at timestep 0, the loss on the later frames"


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family ltx2i2v` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def demo_clips(demo: Path) -> tuple[list, torch.Tensor]:
    """The demo's clips (items) and their pixels (clips, 3, 9, 64, 64) in [-1, 1]."""
    video = clips.Video(fps=16.0, frames=CLIP_BUCKET[2], step=2)
    items = [i for i in scan(demo / "data", log_skipped=False, video=video).items if i.frames > 1]
    pixels = [torch.from_numpy(load_example(i, CLIP_BUCKET, flip=False).pixels) for i in items]
    return items, torch.stack(pixels)


def i2v_clip(pipe, image, frames: int = 5):
    """A clip (frames, 64, 64, 3) in [0, 1] from `image`, two steps, one pass per step."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=image, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
        num_frames=frames, guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0,
        audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
        output_type="np", max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


def clip_loss(demo: Path, transformer, draws: int = 4) -> float:
    """The family's training loss of `transformer` on the demo's clips, fixed draws."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    items, pixels = demo_clips(demo)
    batch = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), [i.caption for i in items])
    kwargs = kind.model_kwargs(batch, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, transformer.config)
    return mean_loss(objective, transformer, kind.encode_latents(pipe.vae, pixels), kwargs, draws)


# --- the demo, detection, the objective --------------------------------------------------------


def test_demo_is_an_image_to_video_pipeline_and_is_detected(demo, tmp_path):
    """The demo is an LTX2ImageToVideoPipeline that renders a clip from an image; the family is
    read from its model_index.json; an LTX2Pipeline folder, a bare transformer and the hub id
    read as ltx2 (one checkpoint for both) and ZT_MODEL_FAMILY=ltx2i2v chooses image-to-video
    on them; the planner counts LTX-2's network."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == "LTX2ImageToVideoPipeline"
    _, pixels = demo_clips(demo)
    frames = i2v_clip(pipe, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    assert families.detect_family(demo / "model") == FAMILY
    t2v = tmp_path / "t2v"
    shutil.copytree(demo / "model", t2v, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((t2v / "model_index.json").read_text())
    (t2v / "model_index.json").write_text(json.dumps(index | {"_class_name": "LTX2Pipeline"}))
    assert families.resolve_family(str(t2v)) == "ltx2"
    assert families.resolve_family(str(t2v), FAMILY) == FAMILY
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == "ltx2"
    assert families.resolve_family("Lightricks/LTX-2") == "ltx2"
    assert families.resolve_family("Lightricks/LTX-2", FAMILY) == FAMILY
    kind = families.get(FAMILY)
    assert kind.pipeline_class() is type(pipe) and kind.sample_input == "first frame"
    # exports name the pipeline an image-to-video family samples with; the others the base's
    exported = {f: families.REGISTRY[f].exported_class for f in (FAMILY, "ltx2", "wani2v", "sdxl")}
    assert exported == {FAMILY: "LTX2ImageToVideoPipeline", "ltx2": "",
                        "wani2v": "WanImageToVideoPipeline", "sdxl": ""}  # fmt: skip
    from zerotuner.families import model_shape

    ltx2 = model_shape("ltx2")
    assert dataclasses.replace(model_shape(FAMILY), family="ltx2", source=ltx2.source) == ltx2


def test_objective_keeps_the_first_frame_clean_at_timestep_0_and_scores_the_rest(demo):
    """A clip's first latent frame is LTX2ImageToVideoPipeline.prepare_latents' image latents
    (the VAE is causal: nothing to cache beside the clip); the family's loss is the pipeline's
    transformer call on the clip with that frame clean, its tokens at `t * (1 - mask)` (the
    pipeline's conditioning mask), the mean squared error over the later frames alone; an image
    (one frame) trains as text-to-video."""
    from diffusers import DiffusionPipeline

    from zerotuner.families.flow_matching import noisy_and_target

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    items, pixels = demo_clips(demo)
    clip = pixels[:2]
    latents = kind.encode_latents(pipe.vae, clip)  # (2, 16, 5, 8, 8)
    assert kind.encode_conditions(clip, lambda px: kind.encode_latents(pipe.vae, px)) == {}
    packed, mask = pipe.prepare_latents(
        clip[:, :, 0], 2, 16, 64, 64, 9, 0.0, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    image_latents = pipe._unpack_latents(packed, 5, 8, 8)[:, :, :1]
    torch.testing.assert_close(latents[:, :, :1], image_latents, atol=1e-5, rtol=1e-5)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert I2V_OBJECTIVE in objective.describe()
    t = torch.tensor([300.0, 800.0])
    torch.testing.assert_close(objective.video_timestep(t, latents), t[:, None] * (1 - mask))
    assert objective.video_timestep(t, latents[:, :, :1]) is t  # an image: one timestep

    text = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), [i.caption for i in items[:2]])
    kwargs = kind.model_kwargs(text, torch.float32)
    with torch.no_grad():
        loss = objective.loss(pipe.transformer, latents, kwargs, dtype=torch.float32,
                              generator=torch.Generator().manual_seed(7))  # fmt: skip
        # the same draws, then the pipeline's own call and the later frames' error
        generator = torch.Generator().manual_seed(7)
        noise = torch.randn(latents.shape, generator=generator)
        sigmas = objective.sigmas(latents, generator)
        noisy, target = noisy_and_target(latents, noise, sigmas)
        noisy[:, :, :1] = image_latents  # prepare_latents: the image's latents, clean
        t = sigmas * 1000
        out = pipe.transformer(
            hidden_states=pipe._pack_latents(noisy), audio_hidden_states=torch.zeros(2, 1, 4),
            timestep=t[:, None] * (1 - mask), audio_timestep=t, sigma=t,
            audio_encoder_hidden_states=torch.zeros(2, 1, 32), num_frames=5, height=8, width=8,
            fps=24.0, audio_num_frames=1, isolate_modalities=True, use_cross_timestep=True,
            return_dict=False, **kwargs,
        )[0]  # fmt: skip
        pred = pipe._unpack_latents(out, 5, 8, 8)
    later = (pred[:, :, 1:] - target[:, :, 1:]).square().mean()
    torch.testing.assert_close(loss, later, atol=1e-5, rtol=1e-4)
    assert not torch.isclose(loss, (pred - target).square().mean(), rtol=1e-3)
    # the first frame's tokens at timestep 0 matter: the same call at t everywhere differs
    with torch.no_grad():
        flat = pipe.transformer(
            hidden_states=pipe._pack_latents(noisy), audio_hidden_states=torch.zeros(2, 1, 4),
            timestep=t, sigma=t, audio_encoder_hidden_states=torch.zeros(2, 1, 32),
            num_frames=5, height=8, width=8, fps=24.0, audio_num_frames=1,
            isolate_modalities=True, use_cross_timestep=True, return_dict=False, **kwargs,
        )[0]  # fmt: skip
    assert (flat - out).abs().max() > 1e-4


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    """Full fine-tuning at ZeRO-3 on 2 ranks, validation clips from the default input (the
    first training clip's first frame)."""
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_exports_an_image_to_video_pipeline(demo, full_run) -> None:
    """ZeRO-3 (zero.Init, optimizer and parameters on the CPU) on 2 ranks: every step logged
    with the image-to-video objective, the clips' loss falls, final/ is an
    LTX2ImageToVideoPipeline that renders a clip from an image; the validation clip was sampled
    from the first training clip's first frame (input | base | trained)."""
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert I2V_OBJECTIVE in log
    assert "samples: every prompt samples from the first frame of" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == "LTX2ImageToVideoPipeline"
    assert clip_loss(demo, final.transformer) < 0.97 * clip_loss(demo, base.transformer)
    _, pixels = demo_clips(demo)
    frames = i2v_clip(final, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    samples = output / "samples"
    (sheet,) = (samples / f"step-{STEPS}").glob("*.png")
    assert sheet.with_suffix(".mp4").is_file() and (samples / "inputs" / sheet.name).is_file()
    assert (samples / "base-vs-trained" / sheet.name).with_suffix(".mp4").is_file()


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(demo, full_run, tmp_path) -> None:
    """From the step-SAVED checkpoint, 1 rank at ZeRO-2 trains on and exports
    LTX2ImageToVideoPipeline folders."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, "LTX2ImageToVideoPipeline")


@pytest.mark.slow
def test_lora_at_zero_3_on_an_ltx2_checkpoint_generates_from_an_image(family_demo_dir, tmp_path):
    """ZT_MODEL_FAMILY=ltx2i2v on an LTX2Pipeline folder (as the hub's LTX-2 is), a LoRA at
    ZeRO-3: trained image-to-video (the objective line), the validation clip sampled from an
    image through LTX2ImageToVideoPipeline; the adapter (`transformer.` keys) loads with its
    load_lora_weights, lowers the clips' loss and changes the clip it renders from an image;
    the merged pipeline folder names that pipeline, not the base folder's LTX2Pipeline."""
    from diffusers import DiffusionPipeline, LTX2ImageToVideoPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    demo = family_demo_dir("ltx2")
    output = tmp_path / "output"
    log = run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=0,
              validation_prompts=[PROMPT], validation_inference_steps=2, lora_merge=True,
              **LORA)  # fmt: skip
    assert I2V_OBJECTIVE in log
    assert "samples: every prompt samples from the first frame of" in log
    final = output / "final"
    merged = json.loads((final / lora_files.MERGED / "model_index.json").read_text())
    assert merged["_class_name"] == "LTX2ImageToVideoPipeline"
    assert type(DiffusionPipeline.from_pretrained(final / lora_files.MERGED)).__name__ == (
        "LTX2ImageToVideoPipeline"
    )
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = LTX2ImageToVideoPipeline.from_pretrained(demo / "model")
    _, pixels = demo_clips(demo)
    image = first_frame(pixels[0])
    before, loss_before = i2v_clip(pipe, image), clip_loss(demo, pipe.transformer)
    pipe.load_lora_weights(final)
    assert clip_loss(demo, pipe.transformer) < 0.97 * loss_before
    assert np.abs(i2v_clip(pipe, image) - before).max() > 1e-3, "the adapter changes nothing"
