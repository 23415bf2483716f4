"""The LTX-2 family (text-to-video, its video path; issue 47).

The tiny demo (real LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video, Gemma3, connectors,
audio VAE and vocoder) loads and generates clips through LTX2Pipeline and is told apart by its
files and its hub id; its video-conditioned and upsampling pipelines are refused in one line; the
cached captions are LTX2Pipeline's own conditioning and the objective calls the transformer as
the pipeline does, the audio stream isolated; the published sizes recount on the meta device.
On 2 CPU ranks at ZeRO-3 (zero.Init, CPU offload) it trains in full: the held-out loss falls,
the export generates in LTX2Pipeline, the checkpoint resumes on one rank at ZeRO-2; a LoRA at
ZeRO-3 on NVMe loads with `LTX2Pipeline.load_lora_weights`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from test_flow_training import (
    PROMPT,
    STEPS,
    TOKENS,
    held_out_loss,
    pipeline_parts,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings

FAMILY = "ltx2"
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
LORA = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family ltx2` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def clip(pipe, prompt: str = PROMPT, frames: int = 5):
    """A short clip (frames, 64, 64, 3) in [0, 1], two steps, one pass per step (no guidance)."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=prompt, num_inference_steps=2, height=64, width=64, num_frames=frames,
        guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0,
        audio_stg_scale=0.0, audio_modality_scale=1.0, output_type="np",
        max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


def test_demo_generates_clips_in_ltx2_pipeline_and_is_detected(demo, tmp_path):
    """The demo is an LTX2Pipeline that renders prompt-dependent clips; the family is read from
    model_index.json, from a bare transformer folder and (offline) from the hub id; its clips
    train 2k + 1 frames (its VAE's 2x in time) in buckets of 8 pixels."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == "LTX2Pipeline"
    first, other = clip(pipe), clip(pipe, "a blue square on a black background")
    assert first.shape == (5, 64, 64, 3) and abs(first - other).mean() > 0
    assert families.detect_family(demo / "model") == FAMILY
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == FAMILY
    assert families.resolve_family("Lightricks/LTX-2") == FAMILY
    assert families.get(FAMILY).frame_step(demo / "model") == pipe.vae_temporal_compression_ratio
    assert families.vae_scale(demo / "model") == pipe.vae_spatial_compression_ratio == 8
    # the planner counts every frozen part of a hub model's configs: Gemma 3, the connectors,
    # both VAEs and the vocoder
    from zerotuner.families.shapes import frozen_params

    parts = ("text_encoder", "connectors", "vae", "audio_vae", "vocoder")
    configs = tmp_path / "configs"
    for part in parts:
        (configs / part).mkdir(parents=True)
        shutil.copy(demo / "model" / part / "config.json", configs / part / "config.json")
    shutil.copy(demo / "model" / "model_index.json", configs / "model_index.json")
    counted = sum(p.numel() for part in parts for p in getattr(pipe, part).parameters())
    assert frozen_params(configs) == counted


@pytest.mark.parametrize("pipeline", ["LTX2ConditionPipeline", "LTX2LatentUpsamplePipeline"])
def test_other_pipelines_are_refused_in_one_line(pipeline, tmp_path, monkeypatch, capsys):
    """LTX-2's video- or keyframe-conditioned pipelines and its upsampler: one line naming what
    is trained (image-to-video is `ltx2i2v`: tests/test_ltx2_i2v.py), exit 2 through `config
    --explain`."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    with pytest.raises(ConfigError) as error:
        families.resolve_family(str(folder))
    text = str(error.value)
    assert "\n" not in text and "does not train" in text and "LTX2Pipeline, ltx2" in text
    assert "LTX2ImageToVideoPipeline, ltx2i2v" in text
    (tmp_path / "data").mkdir()
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=str(folder),
                                       ZT_DATA_DIR=str(tmp_path / "data"),
                                       ZT_OUTPUT_DIR=str(tmp_path / "output"))  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert (code, out, len(errors)) == (2, "", 1) and pipeline in errors[0]


def test_cached_captions_and_objective_are_the_pipelines(demo):
    """What the cache holds for a caption is LTX2Pipeline's: encode_prompt's stacked Gemma
    states through its connectors (their video output and mask); the objective's prediction
    is the transformer's call as the pipeline makes it, with the audio stream isolated."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    captions = [PROMPT, " a blue square on a black background ", "a green circle"]
    ours = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), captions)
    embeds, mask, _, _ = pipe.encode_prompt(
        captions, do_classifier_free_guidance=False, max_sequence_length=TOKENS
    )
    video, _, connector_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert ours["prompt_embeds"].dtype == torch.bfloat16
    torch.testing.assert_close(ours["prompt_embeds"], video.to(torch.bfloat16))
    torch.testing.assert_close(ours["prompt_attention_mask"].float(), connector_mask.float())
    kwargs = kind.model_kwargs(ours, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert "LTX-2's shifted logit_normal(0, 1) by tokens" in objective.describe()
    latents = torch.randn(3, 16, 3, 8, 8)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    with torch.no_grad():
        pred = objective.predict(pipe.transformer, latents, sigmas, kwargs,
                                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        packed = pipe._pack_latents(latents)
        t = sigmas * 1000
        own = pipe.transformer(
            hidden_states=packed, audio_hidden_states=torch.zeros(3, 1, 4), timestep=t,
            sigma=t, audio_encoder_hidden_states=torch.zeros(3, 1, 32), num_frames=3,
            height=8, width=8, fps=24.0, audio_num_frames=1, isolate_modalities=True,
            use_cross_timestep=True, return_dict=False, **kwargs,
        )[0]  # fmt: skip
    torch.testing.assert_close(pred, pipe._unpack_latents(own, 3, 8, 8))
    # what a full fine-tuning trains (`trains`) is exactly what the video loss reaches
    pipe.transformer.zero_grad()
    objective.predict(pipe.transformer, latents, sigmas, kwargs, device=torch.device("cpu"),
                      dtype=torch.float32).square().mean().backward()  # fmt: skip
    kind = families.get(FAMILY)
    for name, param in pipe.transformer.named_parameters():
        reached = param.grad is not None and bool(param.grad.abs().sum() > 0)
        assert reached == kind.trains(name), name


def test_default_lora_targets_are_the_video_streams(demo):
    """ZT_LORA_TARGETS' default (`attention`) adapts the video stream's attention alone: none
    of the audio stream's or the cross-stream layers (no gradient reaches them), every one of
    the video stream's; the adapter's metadata names them so that load_lora_weights rebuilds
    it alike, and the planner counts that adapter."""
    from zerotuner.families import model_shape
    from zerotuner.preflight import trainable
    from zerotuner.weights import lora
    from zerotuner.weights.pipeline_folder import load_part

    kind = families.get(FAMILY)
    transformer = load_part(demo / "model", "transformer")
    attention = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)
                 and any(n.endswith(f".{t}") for t in lora.ATTENTION)}  # fmt: skip
    video = {n for n in attention if kind.trains(f"{n}.weight")}
    assert video and attention - video  # the preset's names match both streams' layers
    settings = Settings(training_type="lora", lora_rank=4)
    config = lora.lora_config(settings, transformer)
    lora.add_adapter(transformer, settings)
    adapted = {n.split(".lora_")[0] for n, p in transformer.named_parameters() if p.requires_grad}
    assert adapted == video
    assert set(lora.metadata(config)["target_modules"]) == video
    planned = trainable.for_settings(settings, model_shape(FAMILY, demo / "model"), demo / "model")
    assert planned.trainable_params == sum(
        p.numel() for p in transformer.parameters() if p.requires_grad
    )


def test_published_sizes_recount_on_the_meta_device():
    """LTX-2.0's transformer (convert_ltx2_to_diffusers.py's config: 18.88B) recounts to the
    registry's; a cached caption is 1024 x 3840 bf16 values; the planner's clip at 121 frames
    of 640 px is 16 latent frames of 20 x 20 tokens, and a full fine-tuning trains the video
    stream alone."""
    from zerotuner.families import REGISTRY, caption_cache_bytes, model_shape

    spec = REGISTRY[FAMILY]
    counted = model_shape(FAMILY, recount=True)
    assert (counted.denoiser_params, counted.largest_param) == spec.builtin_counts
    shape = model_shape(FAMILY)
    assert caption_cache_bytes(shape) == 1024 * 3840 * 2
    assert shape.video is not None and (shape.video.temporal, shape.video.spatial) == (8, 32)
    assert shape.video.tokens(121, 640) == 16 * 20 * 20
    from zerotuner.preflight import trainable

    full = trainable.for_settings(Settings(), shape)  # the audio stream frozen: 5.83B
    assert (full.trainable_params, full.frozen_params) == (13_041_520_768, 5_834_653_824)


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_trains_and_exports_an_ltx2_pipeline(demo, full_run):
    """ZeRO-3 (zero.Init, optimizer and parameters on the CPU) on 2 ranks: every step logged
    with LTX-2's objective, the held-out loss falls, final/ is an LTX2Pipeline that renders a
    clip, the validation sample is a clip."""
    import numpy as np
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "LTX-2's shifted logit_normal" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == "LTX2Pipeline"
    before = held_out_loss(demo, FAMILY, base.transformer)
    assert held_out_loss(demo, FAMILY, final.transformer) < 0.97 * before
    frames = clip(final)
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    # the audio stream was frozen: exported as it was (weight decay did not touch it)
    kind, kept = families.get(FAMILY), base.transformer.state_dict()
    for name, param in final.transformer.named_parameters():
        assert torch.equal(param, kept[name]) != kind.trains(name), name
    assert list((output / "samples" / f"step-{STEPS}").glob("*.mp4"))


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(demo, full_run, tmp_path) -> None:
    """From the step-SAVED checkpoint, 1 rank at ZeRO-2 trains on and exports LTX2Pipelines."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, "LTX2Pipeline")


@pytest.mark.slow
def test_lora_at_zero_3_loads_in_ltx2_pipeline(demo, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 with everything on NVMe: `transformer.` keys that
    LTX2Pipeline.load_lora_weights loads, lowering the held-out loss and changing the clip."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=0, **LORA)
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    before, loss_before = clip(pipe), held_out_loss(demo, FAMILY, pipe.transformer)
    pipe.load_lora_weights(final)
    assert held_out_loss(demo, FAMILY, pipe.transformer) < 0.97 * loss_before
    assert np.abs(clip(pipe) - before).max() > 1e-3, "the adapter changes nothing"
