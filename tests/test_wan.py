"""The Wan family (Wan 2.1 / 2.2 text-to-video), first slice: images trained as one-frame clips.

The tiny demo (real WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, the published
UniPC scheduler) loads and generates clips through WanPipeline and is told apart by its files and
its hub id; Wan 2.2 A14B (two experts) and the image-conditioned pipelines are refused in one
line; the cached captions are WanPipeline's own conditioning and the objective takes the
scheduler's `flow_shift`; the published sizes recount on the meta device and Wan 2.2's 16x VAE
sizes buckets right. On 2 CPU ranks at ZeRO-3 (zero.Init, CPU offload, EMA) it trains in full:
the held-out loss falls, the export generates in WanPipeline, the checkpoint resumes on one
rank at ZeRO-2; a LoRA at ZeRO-3 on NVMe loads with `WanPipeline.load_lora_weights`.
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
    SAVED,
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
from zerotuner.weights.checkpoint import read_manifest

FAMILY = "wan"
OFFLOADED_LINE = "gradient checkpointing: each block's input waits in host memory"
HUB_IDS = ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
           "Wan-AI/Wan2.2-TI2V-5B-Diffusers")  # fmt: skip
# checkpointed, its blocks' inputs in host memory (ZT_OFFLOAD_ACTIVATIONS=cpu, the plan's
# choice for Wan 14B's 81-frame clips on one 24 GB GPU)
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "ema": True,
        "gradient_checkpointing": True, "offload_activations": "cpu"}  # fmt: skip
LORA = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lora_merge": True,
        "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family wan` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def clip(pipe, prompt: str = PROMPT, frames: int = 1):
    """A short clip (frames, 64, 64, 3) in [0, 1], two steps."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=prompt, num_inference_steps=2, height=64, width=64, num_frames=frames,
        output_type="np", max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


# --- the demo, detection, refusals ------------------------------------------------------------


def test_demo_generates_clips_in_wan_pipeline_and_is_detected(demo, tmp_path):
    """The demo is a WanPipeline (UniPC with flow sigmas, as published) that renders one-frame
    and 5-frame clips depending on the prompt; the family is read from model_index.json, from a
    bare transformer folder and (offline) from the published hub ids."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert (type(pipe).__name__, type(pipe.scheduler).__name__) == (
        "WanPipeline", "UniPCMultistepScheduler",
    )  # fmt: skip
    first, other = clip(pipe), clip(pipe, "a blue square on a black background")
    assert first.shape == (1, 64, 64, 3) and abs(first - other).mean() > 0
    assert clip(pipe, frames=5).shape == (5, 64, 64, 3)
    assert families.detect_family(demo / "model") == FAMILY
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == FAMILY
    for hub_id in HUB_IDS:
        assert families.resolve_family(hub_id) == FAMILY
    assert families.vae_scale(demo / "model") == pipe.vae.config.scale_factor_spatial == 4


def test_wan_22_vae_sizes_buckets_at_16_pixels(tmp_path):
    """Wan 2.2 TI2V-5B's AutoencoderKLWan (z_dim 48, 2x2 pixel patches, then three halvings)
    is 16 pixels per latent cell, as its config's scale_factor_spatial says; Wan 2.1's 8."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    with init_empty_weights():
        wan22 = AutoencoderKLWan(
            base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2,
            scale_factor_spatial=16, temperal_downsample=[False, True, True],
        )  # fmt: skip
        wan21 = AutoencoderKLWan()
    for name, vae, scale in (("wan22", wan22, 16), ("wan21", wan21, 8)):
        vae.save_config(tmp_path / name / "vae")
        assert families.vae_scale(tmp_path / name) == vae.config.scale_factor_spatial == scale


@pytest.mark.parametrize(
    ("name", "index", "says"),
    [("Wan-AI/Wan2.2-T2V-A14B-Diffusers", {"transformer_2": ["diffusers", "WanTransformer3DModel"],
      "boundary_ratio": 0.875}, "two expert transformers"),
     ("Wan-AI/Wan2.2-Animate-14B-Diffusers", {"_class_name": "WanAnimatePipeline"},
      "image- or video-conditioned"),
     ("Wan-AI/Wan2.1-VACE-1.3B-diffusers", {"_class_name": "WanVACEPipeline"},
      "image- or video-conditioned")],
)  # fmt: skip
def test_experts_and_image_to_video_are_refused_in_one_line(
    name, index, says, tmp_path, monkeypatch, capsys
):
    """Wan 2.2 A14B (a transformer_2) and the image-conditioned pipelines: by hub id (offline),
    by model_index.json and through `zerotuner config --explain`, one line naming what is
    trained, exit 2; TI2V-5B's (transformer_2 null) is a WanPipeline and trains."""
    folder = tmp_path / "model"
    folder.mkdir()
    components = {"_class_name": "WanPipeline", "transformer": ["diffusers",
                  "WanTransformer3DModel"], "transformer_2": [None, None], **index}  # fmt: skip
    (folder / "model_index.json").write_text(json.dumps(components))
    for model in (name, str(folder)):
        with pytest.raises(ConfigError) as error:
            families.resolve_family(model)
        text = str(error.value)
        assert "\n" not in text and says in text and "WanPipeline" in text
    (tmp_path / "data").mkdir()
    code, out, _ = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=str(folder),
                                     ZT_DATA_DIR=str(tmp_path / "data"),
                                     ZT_OUTPUT_DIR=str(tmp_path / "output"))  # fmt: skip
    assert (code, out) == (2, "")
    from zerotuner.cli import main

    assert main(["check"]) == 2  # the local folder: `check`'s model line fails, in one line
    (failed,) = [line for line in capsys.readouterr().out.splitlines() if "model " in line]
    assert failed.startswith("FAIL model") and says in failed
    ti2v = {**components, "_class_name": "WanPipeline", "transformer_2": [None, None],
            "expand_timesteps": True}  # Wan2.2-TI2V-5B-Diffusers' model_index.json  # fmt: skip
    (folder / "model_index.json").write_text(json.dumps(ti2v))
    assert families.resolve_family(str(folder)) == FAMILY
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=name,
                                       ZT_DATA_DIR=str(tmp_path / "data"))  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert (code, out, len(errors)) == (2, "", 1) and says in errors[0]


def test_a_conditioned_transformer_alone_is_refused_but_image_to_video_is_its_family(
    demo, tmp_path
):
    """A bare WanTransformer3DModel that takes more than the noise is refused as its pipeline
    is, unless it is image-to-video's shape (36 channels in for 16 out: the `wani2v` family)."""
    bare = tmp_path / "bare" / "transformer"
    shutil.copytree(demo / "model" / "transformer", bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "in_channels": 48}))
    with pytest.raises(ConfigError, match="image- or video-conditioned"):
        families.detect_family(bare.parent)
    (bare / "config.json").write_text(json.dumps({**config, "in_channels": 36}))
    assert families.detect_family(bare.parent) == "wani2v"


def test_cached_captions_and_objective_are_the_pipelines(demo):
    """What the cache holds for a caption is WanPipeline.encode_prompt's (UMT5 with the mask,
    zeros past the caption); the objective shifts by the UniPC scheduler's flow_shift and
    feeds the transformer one-frame clips."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    captions = [PROMPT, "a  blue square on a black background", "a green circle"]
    ours = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), captions)
    embeds, _ = pipe.encode_prompt(
        captions, do_classifier_free_guidance=False, max_sequence_length=TOKENS
    )
    assert ours["prompt_embeds"].dtype == torch.bfloat16
    torch.testing.assert_close(ours["prompt_embeds"], embeds.to(torch.bfloat16))
    assert not ours["prompt_embeds"][2, 5:].any()  # "a green circle" and </s>: 4 tokens
    kwargs = kind.model_kwargs(ours, torch.float32)
    assert set(kwargs) == {"encoder_hidden_states"}
    scheduler = kind.scheduler_class().from_pretrained(demo / "model", subfolder="scheduler")
    objective = kind.objective(Settings(), scheduler, pipe.transformer.config)
    assert objective.config.shift == scheduler.config.flow_shift == 3.0
    assert objective.describe() == "flow matching (sigmas logit_normal(0, 1), shift 3)"
    latents = torch.randn(3, 16, 8, 8)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    with torch.no_grad():
        pred = objective.predict(pipe.transformer, latents, sigmas, kwargs,
                                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        states = kwargs["encoder_hidden_states"]
        own = pipe.transformer(hidden_states=latents.unsqueeze(2), timestep=sigmas * 1000,
                               encoder_hidden_states=states).sample  # fmt: skip
    torch.testing.assert_close(pred, own.squeeze(2))


def test_published_sizes_recount_on_the_meta_device():
    """Wan2.1-T2V-1.3B's transformer (convert_wan_to_diffusers.py's config), UMT5-XXL (its
    embedding once: `encoder.embed_tokens` is tied to `shared` on load) and AutoencoderKLWan's
    defaults are the registry's counts; a cached caption is 512 x 4096 bf16 values."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from zerotuner.families import REGISTRY, caption_cache_bytes, model_shape

    spec = REGISTRY[FAMILY]
    counted = model_shape(FAMILY, recount=True)
    assert (counted.denoiser_params, counted.largest_param) == spec.builtin_counts
    with init_empty_weights():
        umt5 = UMT5EncoderModel(UMT5Config(
            d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        ))  # fmt: skip
        vae = AutoencoderKLWan()
    umt5.tie_weights()
    assert sum(p.numel() for p in umt5.parameters()) == spec.text_params
    assert sum(p.numel() for p in vae.parameters()) == spec.vae_params
    assert caption_cache_bytes(model_shape(FAMILY)) == 512 * 4096 * 2


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_check_lists_the_buckets_the_run_built(demo, full_run, tmp_path, capsys) -> None:
    """One bucket rule: `check` at the run's settings names exactly its buckets (clips too)."""
    output, _ = full_run
    trained = set(json.loads((output / "run" / "dataset.json").read_text())["buckets"])
    assert "64x64x9" in trained
    listed = tk.checked_buckets(capsys, model=demo / "model", data=demo / "data",
                                output=tmp_path / "out", cache=tmp_path / "cache",
                                offload_dir=tmp_path / "offload", resolution=64)  # fmt: skip
    assert listed == trained


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_trains_and_exports_a_wan_pipeline(demo, full_run) -> None:
    """ZeRO-3 (zero.Init, optimizer and parameters on the CPU, EMA) on 2 ranks, checkpointed
    with the blocks' inputs in host memory: every step logged with the shifted objective, the
    held-out loss falls, final/ is a WanPipeline that renders a clip, the validation sample is
    an image, the EMA is another model."""
    import numpy as np
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "flow matching (sigmas logit_normal(0, 1), shift 3)" in log
    assert OFFLOADED_LINE in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == "WanPipeline"
    before = held_out_loss(demo, FAMILY, base.transformer)
    assert held_out_loss(demo, FAMILY, final.transformer) < 0.97 * before
    frames = clip(final, frames=5)
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")  # the contact sheet
    assert sample.stat().st_size > 0 and sample.with_suffix(".mp4").is_file()
    # The demo's clips trained as clips (9 frames, latents of 5 frames), its images as frames.
    buckets = json.loads((output / "run" / "dataset.json").read_text())["buckets"]
    assert buckets.get("64x64x9") == 8 and sum(buckets.values()) == 72, buckets
    assert "64 images and 8 clips (4.0 s)" in log
    manifest = read_manifest(output / "checkpoints" / f"step-{SAVED}")
    assert (manifest["family"], manifest["zero_stage"]) == (FAMILY, 3)
    ema = DiffusionPipeline.from_pretrained(output / "final-ema").transformer
    assert any(not torch.equal(a, b) for a, b in
               zip(ema.parameters(), final.transformer.parameters(), strict=True))  # fmt: skip


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(demo, full_run, tmp_path) -> None:
    """From the step-5 checkpoint, 1 rank at ZeRO-2 (the universal checkpoint) trains steps
    6-10, EMA included, and exports WanPipeline folders."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, "WanPipeline")


@pytest.mark.slow
def test_lora_at_zero_3_loads_in_wan_pipeline(demo, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 with everything on NVMe: `transformer.` keys that
    WanPipeline.load_lora_weights loads, lowering the held-out loss and changing the clip;
    the merged pipeline renders the same clip."""
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
    adapted = clip(pipe)
    assert held_out_loss(demo, FAMILY, pipe.transformer) < 0.97 * loss_before
    assert np.abs(adapted - before).max() > 1e-3, "the adapter changes nothing"
    merged = clip(DiffusionPipeline.from_pretrained(final / lora_files.MERGED))
    assert np.abs(merged - adapted).max() < 1e-3
