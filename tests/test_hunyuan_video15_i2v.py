"""HunyuanVideo 1.5 image-to-video (`hunyuanvideo15i2v`, issue 47): the tiny demo (the
hunyuanvideo15 demo's parts with a SigLIP image encoder, saved as a
HunyuanVideo15ImageToVideoPipeline) renders a clip from an image and is told apart by its files
and the published hub ids; what the cache holds for a clip is what the pipeline conditions on
(the first frame's latents and SigLIP states, in a cache entry of their own), and the objective
feeds the transformer as the pipeline does; the published sizes recount on the meta device. On
2 CPU ranks at ZeRO-3 it trains in full (the clips' loss falls, validation clips from an input
image, export as HunyuanVideo15ImageToVideoPipeline, resume on one rank at ZeRO-2) and as a
LoRA on NVMe whose adapter loads with that pipeline's load_lora_weights.
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
    pipeline_parts,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)
from test_ltx2_i2v import demo_clips
from test_wan_i2v import conditioned_loss, first_frame

from zerotuner import families
from zerotuner.settings.schema import Settings

FAMILY = "hunyuanvideo15i2v"
PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
HUB_IDS = ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
           "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v",
           "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v_distilled")  # fmt: skip
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
LORA = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2,
        "param_buffer": 2048 * 2048}  # its ByT5 projection's 2048 x 2048, even tiny  # fmt: skip
I2V_OBJECTIVE = "the first frame's latents, mask and image states beside the noise"


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family hunyuanvideo15i2v` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def i2v_clip(pipe, image, frames: int = 5):
    """A clip (frames, 64, 64, 3) in [0, 1] from `image` (64 px: the demo's target size), two
    steps with the demo's guidance."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=image, prompt=PROMPT, num_inference_steps=2, num_frames=frames,
        output_type="np", generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


def clip_loss(demo: Path, transformer, draws: int = 3) -> float:
    """The family's training loss of `transformer` on the demo's clips, fixed draws, the first
    frame's condition and image states as the cache holds them."""
    return conditioned_loss(demo, FAMILY, transformer, demo_clips(demo), draws)


# --- the demo, detection, the cache, the objective ---------------------------------------------


def test_demo_is_an_image_to_video_pipeline_and_is_detected(demo, tmp_path):
    """The demo is a HunyuanVideo15ImageToVideoPipeline that renders a clip from an image; the
    family is read from its model_index.json and (offline) from the published i2v hub ids,
    which no longer refuse, while the t2v ones stay hunyuanvideo15; its LoRA pipeline is the
    image-to-video one; the planner counts the image encoder with the frozen parts."""
    from diffusers import DiffusionPipeline, HunyuanVideo15ImageToVideoPipeline

    from zerotuner.families.shapes import frozen_params

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == PIPELINE
    _, pixels = demo_clips(demo)
    frames = i2v_clip(pipe, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    assert families.detect_family(demo / "model") == FAMILY
    for hub_id in HUB_IDS:
        assert families.resolve_family(hub_id) == FAMILY
    t2v = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    assert families.resolve_family(t2v) == "hunyuanvideo15"
    assert families.resolve_family(t2v, FAMILY) == FAMILY
    kind = families.get(FAMILY)
    lora = kind.pipeline_class()
    assert issubclass(lora, HunyuanVideo15ImageToVideoPipeline) and lora.load_lora_weights
    assert kind.sample_input == "first frame"
    assert families.REGISTRY[FAMILY].exported_class == PIPELINE
    counted = sum(p.numel() for part in ("text_encoder", "text_encoder_2", "vae", "image_encoder")
                  for p in getattr(pipe, part).parameters())  # fmt: skip
    assert frozen_params(demo / "model") == counted


def test_a_text_to_video_folder_is_refused_as_image_to_video_in_one_line(
    family_demo_dir, tmp_path, monkeypatch, capsys
):
    """ZT_MODEL_FAMILY=hunyuanvideo15i2v on a text-to-video pipeline folder (no SigLIP to read
    the first frame with): one line naming what is missing, exit 2, before anything is cached."""
    t2v = family_demo_dir("hunyuanvideo15")
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(t2v / "model"), ZT_MODEL_FAMILY=FAMILY,
        ZT_DATA_DIR=str(t2v / "data"), ZT_OUTPUT_DIR=str(tmp_path / "output"),
    )  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert (code, out, len(errors)) == (2, "", 1), err
    assert "image_encoder and feature_extractor" in errors[0] and PIPELINE in errors[0]
    assert "Traceback" not in err


def test_cached_conditions_and_objective_are_the_pipelines(demo):
    """A clip's cached condition latents are the pipeline's `_get_image_latents` of its first
    frame and its image states `encode_image`'s; the objective's prediction is the transformer
    on cat([noisy, condition, mask]) (`prepare_cond_latents_and_mask`) with those states, the
    loss its error on every frame; an image trains as text-to-video; a full fine-tuning
    reaches the image projection."""
    from diffusers import DiffusionPipeline

    from zerotuner.families.flow_matching import noisy_and_target

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    items, pixels = demo_clips(demo)
    clip = pixels[:2]
    encoder = kind.load_image_encoder(demo / "model", torch.device("cpu"))

    def encode(px: torch.Tensor) -> torch.Tensor:
        return kind.encode_latents(pipe.vae, px)

    ours = kind.encode_conditions(clip, encode, encoder)
    images = [first_frame(c) for c in clip]
    image_latents = torch.cat([
        pipe._get_image_latents(pipe.vae, pipe.video_processor, image, 64, 64, "cpu")
        for image in images
    ])  # fmt: skip
    torch.testing.assert_close(ours["condition_latents"], image_latents, atol=1e-5, rtol=1e-5)
    states = torch.cat([pipe.encode_image(image, 1, "cpu", torch.float32) for image in images])
    torch.testing.assert_close(ours["image_embeds"], states)

    text = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), [i.caption for i in items[:2]])
    kwargs = kind.model_kwargs(text | ours, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert I2V_OBJECTIVE in objective.describe() and "shift 3" in objective.describe()
    latents = encode(clip)  # (2, 8, 5, 8, 8)
    with torch.no_grad():
        loss = objective.loss(pipe.transformer, latents, kwargs, dtype=torch.float32,
                              generator=torch.Generator().manual_seed(7))  # fmt: skip
        generator = torch.Generator().manual_seed(7)  # the same draws, the pipeline's own call
        noise = torch.randn(latents.shape, generator=generator)
        sigmas = objective.sigmas(latents, generator)
        noisy, target = noisy_and_target(latents, noise, sigmas)
        condition, mask = [], []
        for image in images:
            c, m = pipe.prepare_cond_latents_and_mask(noisy[:1], image, 1, 64, 64, torch.float32,
                                                      "cpu")  # fmt: skip
            condition.append(c)
            mask.append(m)
        own = {k: v for k, v in kwargs.items() if k not in ("condition", "image_embeds")}
        pred = pipe.transformer(
            hidden_states=torch.cat([noisy, torch.cat(condition), torch.cat(mask)], dim=1),
            image_embeds=states, timestep=sigmas * 1000, return_dict=False, **own,
        )[0]  # fmt: skip
    torch.testing.assert_close(loss, (pred - target).square().mean(), atol=1e-5, rtol=1e-4)
    # an image (one frame) is text-to-video: zero condition, mask and image states
    still = latents[:, :, 0]
    sigmas = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        pred = objective.predict(pipe.transformer, still, sigmas, kwargs,
                                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        zero = pipe.transformer(
            hidden_states=torch.cat([still[:, :, None], torch.zeros(2, 9, 1, 8, 8)], dim=1),
            image_embeds=torch.zeros_like(states), timestep=sigmas * 1000, return_dict=False,
            **own,
        )[0][:, :, 0]  # fmt: skip
    torch.testing.assert_close(pred, zero)
    pipe.transformer.zero_grad()
    objective.loss(pipe.transformer, latents, kwargs, dtype=torch.float32,
                   generator=torch.Generator().manual_seed(1)).backward()  # fmt: skip
    projection = pipe.transformer.image_embedder.linear_1.weight.grad
    assert kind.trains("image_embedder.linear_1.weight") and projection.abs().sum() > 0


def test_cache_entry_follows_the_image_encoder(demo, tmp_path):
    """The clips' cache key holds the image encoder's and its processor's files and a tag of
    its own: another encoder, or the text-to-video family on the same folder, is another
    entry."""
    from zerotuner.train import feature_cache

    kind, t2v = families.get(FAMILY), families.get("hunyuanvideo15")

    def key(family, folder: Path) -> str:
        parts = family.latent_subfolders()
        return feature_cache.component_key(folder, parts) + family.latent_cache_tag()

    model = tmp_path / "model"
    shutil.copytree(demo / "model", model)
    before = key(kind, model)
    assert before != key(t2v, model)
    config = model / "image_encoder" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"layer_norm_eps": 1e-5}))
    assert key(kind, model) != before


def test_published_sizes_recount_on_the_meta_device():
    """The published 480p i2v transformer (text-to-video's class and size, task_type i2v)
    recounts to the registry's; its frozen parts are text-to-video's and SigLIP so400m's vision
    tower (FLUX.1 Redux's image encoder), which a full fine-tuning leaves frozen while it trains
    the image projection too."""
    from accelerate import init_empty_weights
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from zerotuner.families import REGISTRY, model_shape
    from zerotuner.preflight import trainable

    spec, t2v = REGISTRY[FAMILY], REGISTRY["hunyuanvideo15"]
    counted = model_shape(FAMILY, recount=True)
    assert (counted.denoiser_params, counted.largest_param) == spec.builtin_counts
    assert spec.builtin_counts == t2v.builtin_counts
    with init_empty_weights():
        siglip = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
            num_attention_heads=16, image_size=384, patch_size=14))  # fmt: skip
    assert spec.text_params - t2v.text_params == sum(p.numel() for p in siglip.parameters())
    assert (384 // 14) ** 2 == 729  # the transformer's vision tokens
    shape = model_shape(FAMILY)
    assert trainable.for_settings(Settings(), shape).trainable_params == spec.builtin_counts[0]
    assert shape.frozen_params == model_shape("hunyuanvideo15").frozen_params + (
        spec.text_params - t2v.text_params
    )


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    """Full fine-tuning at ZeRO-3 on 2 ranks, validation clips from the default input (the
    first training clip's first frame)."""
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_exports_an_image_to_video_pipeline(demo, full_run) -> None:
    """ZeRO-3 (zero.Init, optimizer and parameters on the CPU) on 2 ranks: every step logged
    with the image-to-video objective, the clips' loss falls, final/ is a
    HunyuanVideo15ImageToVideoPipeline that renders a clip from an image; the validation clip
    was sampled from the first training clip's first frame (input | base | trained)."""
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert I2V_OBJECTIVE in log
    assert "samples: every prompt samples from the first frame of" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == PIPELINE
    assert clip_loss(demo, final.transformer) < 0.97 * clip_loss(demo, base.transformer)
    _, pixels = demo_clips(demo)
    frames = i2v_clip(final, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    samples = output / "samples"
    (sheet,) = (samples / f"step-{STEPS}").glob("*.png")
    assert sheet.with_suffix(".mp4").is_file() and (samples / "inputs" / sheet.name).is_file()


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(demo, full_run, tmp_path) -> None:
    """From the step-SAVED checkpoint, 1 rank at ZeRO-2 trains on and exports
    HunyuanVideo15ImageToVideoPipeline folders."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_on_nvme_generates_from_an_image(demo, tmp_path) -> None:
    """A LoRA at ZeRO-3 with everything on NVMe, trained image-to-video (the objective line),
    its validation clip sampled from an image: the adapter (`transformer.` keys) loads with the
    family's image-to-video pipeline's load_lora_weights, lowers the clips' loss and changes
    the clip it renders from an image."""
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    log = run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=0,
              validation_prompts=[PROMPT], validation_inference_steps=2, **LORA)  # fmt: skip
    assert I2V_OBJECTIVE in log
    assert "samples: every prompt samples from the first frame of" in log
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = families.get(FAMILY).pipeline_class().from_pretrained(demo / "model")
    _, pixels = demo_clips(demo)
    image = first_frame(pixels[0])
    before, loss_before = i2v_clip(pipe, image), clip_loss(demo, pipe.transformer)
    pipe.load_lora_weights(final)
    assert clip_loss(demo, pipe.transformer) < 0.97 * loss_before
    assert np.abs(i2v_clip(pipe, image) - before).max() > 1e-3, "the adapter changes nothing"
    assert list((output / "samples" / f"step-{STEPS}").glob("*.mp4"))
