"""Wan image-to-video (`wani2v`, issue 44): the tiny demo (a WanImageToVideoPipeline with a
36-channel WanTransformer3DModel, a CLIP image encoder, the wan demo's clips) is told apart by
its files, its bare transformer and the published hub ids; what the cache holds for a clip is
what the pipeline conditions on (the first frame's condition latents, mask and CLIP states), and
the objective feeds the transformer as the pipeline does. On 2 CPU ranks at ZeRO-3 it trains in
full (the held-out loss on the clips falls, validation clips from an input image, resume on one
rank) and as a LoRA; the export and the adapter generate a clip from an image through
WanImageToVideoPipeline.
"""

from __future__ import annotations

import dataclasses
import functools
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

from zerotuner import families
from zerotuner.data import clips, held_out
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings

FAMILY = "wani2v"
HUB_IDS = ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers")
CLIP_BUCKET = (64, 64, 9)  # the demo's clips: 9 frames of 64 x 64
EVAL_FRACTION = 0.2  # the full run's: 14 of the 72 demo items, one of them a clip
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
        "gradient_checkpointing": True}  # fmt: skip
LORA = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family wani2v` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def scanned_items(demo: Path) -> list:
    video = clips.Video(fps=16.0, frames=CLIP_BUCKET[2], step=4)
    return scan(demo / "data", log_skipped=False, video=video).items


@functools.cache
def held_out_seed(demo: Path) -> int:
    """The full run's ZT_SEED: the first from the default whose held-out fraction
    (EVAL_FRACTION) holds exactly one clip. Which items a seed holds out follows their content
    digests, and H.264 encodes of the same frames have differed between processes."""
    scanned = scanned_items(demo)
    for seed in range(Settings().seed, Settings().seed + 100):
        held = held_out.held_out(scanned, EVAL_FRACTION, seed)
        if sum(scanned[n].frames > 1 for n in held) == 1:
            return seed
    raise AssertionError("no seed holds out exactly one clip")


def demo_clips(demo: Path, held: bool = False) -> tuple[list, torch.Tensor]:
    """The demo's clips (items) and their pixels (clips, 3, 9, 64, 64) in [-1, 1]; `held`: only
    those the full run holds out (ZT_EVAL_FRACTION=EVAL_FRACTION, its held_out_seed)."""
    scanned = scanned_items(demo)
    out = set(held_out.held_out(scanned, EVAL_FRACTION, held_out_seed(demo))) if held else None
    items = [i for n, i in enumerate(scanned) if i.frames > 1 and (out is None or n in out)]
    pixels = [torch.from_numpy(load_example(i, CLIP_BUCKET, flip=False).pixels) for i in items]
    return items, torch.stack(pixels)


def first_frame(pixels: torch.Tensor):
    """A clip's (3, frames, h, w) first frame as a PIL image: what a user gives the pipeline."""
    from PIL import Image

    return Image.fromarray(((pixels[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())


def i2v_clip(pipe, image, frames: int = 5):
    """A clip (frames, 64, 64, 3) in [0, 1] from `image`, two steps."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=image, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
        num_frames=frames, output_type="np", max_sequence_length=TOKENS,
        generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


def clip_loss(demo: Path, transformer, draws: int = 3, held: bool = False) -> float:
    """The family's training loss of `transformer` on the demo's clips (`held`: the held-out
    ones), fixed draws: the first frame's condition and image states as the cache holds them."""
    return conditioned_loss(demo, FAMILY, transformer, demo_clips(demo, held), draws)


def conditioned_loss(demo: Path, family: str, transformer, clips: tuple, draws: int) -> float:
    """An image-to-video `family`'s training loss of `transformer` on `clips` (the demo's
    items and their pixels), fixed draws, with what its cache holds beside the latents
    (`encode_conditions` with its image encoder)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(family), max_sequence_length=TOKENS)
    items, pixels = clips
    batch = kind.encode_text(pipeline_parts(pipe, family, kind), [i.caption for i in items])

    def encode(px: torch.Tensor) -> torch.Tensor:
        return kind.encode_latents(pipe.vae, px)

    encoder = kind.load_image_encoder(demo / "model", torch.device("cpu"))
    batch |= kind.encode_conditions(pixels, encode, encoder)
    kwargs = kind.model_kwargs(batch, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, transformer.config)
    return mean_loss(objective, transformer, encode(pixels), kwargs, draws)


# --- the demo, detection, the conditioning -----------------------------------------------------


def test_demo_is_an_image_to_video_pipeline_and_is_detected(demo, tmp_path):
    """The demo is a WanImageToVideoPipeline (a CLIP image encoder, a 36-channel transformer)
    that renders a clip from an image; the family is read from model_index.json, from a bare
    transformer folder and (offline) from the published hub ids, which no longer refuse; Wan
    2.2 I2V A14B asks for ZT_EXPERT as its text-to-video sibling does."""
    from diffusers import DiffusionPipeline

    from zerotuner.errors import ConfigError

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    assert pipe.transformer.config.in_channels == 36 and pipe.transformer.config.image_dim
    _, pixels = demo_clips(demo)
    frames = i2v_clip(pipe, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    assert families.detect_family(demo / "model") == FAMILY
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == FAMILY
    for hub_id in HUB_IDS:
        assert families.resolve_family(hub_id) == FAMILY
    assert families.resolve_family("Wan-AI/Wan2.2-TI2V-5B-Diffusers") == "wan"
    assert families.resolve_family("Wan-AI/Wan2.2-I2V-A14B-Diffusers", expert="high") == FAMILY
    with pytest.raises(ConfigError, match="ZT_EXPERT=high"):
        families.resolve_family("Wan-AI/Wan2.2-I2V-A14B-Diffusers")
    # the first-last-frame model shares the pipeline and the channels; its transformer's
    # positional embedding of two frames' image states says it, in a folder as in a bare one
    flf2v = tmp_path / "flf2v"
    shutil.copytree(demo / "model", flf2v, ignore=shutil.ignore_patterns("*.safetensors"))
    for folder in (flf2v, bare):
        config = folder / "transformer" / "config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"pos_embed_seq_len": 514}))
        with pytest.raises(ConfigError, match="first-last-frame") as refused:
            families.detect_family(folder)
        assert "\n" not in str(refused.value)


def test_cached_condition_and_objective_are_the_pipelines(demo):
    """A clip's cached condition latents are WanImageToVideoPipeline.prepare_latents' (the VAE
    of [first frame, zeros], normalised), its mask the pipeline's, its image states
    `encode_image`'s of the first frame; the objective's prediction is the transformer on
    cat([noisy, mask, condition]) with those states."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = families.get(FAMILY)
    _, pixels = demo_clips(demo)
    clip = pixels[:1]
    encoder = kind.load_image_encoder(demo / "model", torch.device("cpu"))
    ours = kind.encode_conditions(clip, lambda px: kind.encode_latents(pipe.vae, px), encoder)
    _, theirs = pipe.prepare_latents(clip[:, :, 0], 1, 16, 64, 64, 9, torch.float32,
                                     torch.device("cpu"))  # fmt: skip
    torch.testing.assert_close(ours["condition_latents"], theirs[:, 4:], atol=1e-5, rtol=1e-5)
    from zerotuner.families.wan_i2v import first_frame_mask

    torch.testing.assert_close(first_frame_mask(ours["condition_latents"]), theirs[:, :4])
    torch.testing.assert_close(ours["image_embeds"], pipe.encode_image(first_frame(clip[0])))
    kwargs = kind.model_kwargs({"prompt_embeds": torch.randn(1, TOKENS, 64), **ours}, torch.float32)
    scheduler = kind.scheduler_class().from_pretrained(demo / "model", subfolder="scheduler")
    objective = kind.objective(Settings(), scheduler, pipe.transformer.config)
    assert "first frame's latents and mask beside the noise" in objective.describe()
    latents = torch.randn(1, 16, 3, 16, 16)
    sigmas = torch.tensor([0.6])
    with torch.no_grad():
        pred = objective.predict(pipe.transformer, latents, sigmas, kwargs,
                                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        own = pipe.transformer(
            hidden_states=torch.cat([latents, theirs], dim=1), timestep=sigmas * 1000,
            encoder_hidden_states=kwargs["encoder_hidden_states"],
            encoder_hidden_states_image=pipe.encode_image(first_frame(clip[0])),
        ).sample  # fmt: skip
    torch.testing.assert_close(pred, own, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def a14b(demo, tmp_path_factory) -> Path:
    """The demo as Wan 2.2 I2V A14B: no image encoder (transformers without `image_dim`), a
    transformer_2 and boundary_ratio 0.9 in model_index.json; data/ the demo's."""
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("i2v-a14b")
    model = root / "model"
    shutil.copytree(demo / "model", model, ignore=shutil.ignore_patterns("image_*"))
    config = WanTransformer3DModel.load_config(model / "transformer")
    config |= {"image_dim": None, "added_kv_proj_dim": None}
    for seed, part in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(seed)
        shutil.rmtree(model / part, ignore_errors=True)
        WanTransformer3DModel.from_config(config).save_pretrained(model / part)
    index = json.loads((model / "model_index.json").read_text())
    index |= {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.9,
              "image_encoder": [None, None], "image_processor": [None, None]}  # fmt: skip
    (model / "model_index.json").write_text(json.dumps(index))
    (root / "data").symlink_to(demo / "data")
    return root


def test_the_a14b_trains_one_expert_without_image_states(a14b, tmp_path, monkeypatch, capsys):
    """Wan 2.2 I2V A14B: refused without ZT_EXPERT, planned with it (`config`), its expert's
    folder the denoiser and its sigmas the expert's part; its cache holds no image states (no
    image encoder) and it generates a clip from an image."""
    from diffusers import DiffusionPipeline

    from zerotuner.errors import ConfigError

    with pytest.raises(ConfigError, match="ZT_EXPERT"):
        families.detect_family(a14b / "model")
    assert families.detect_family(a14b / "model", expert="low") == FAMILY
    (tmp_path / "data").mkdir()
    how = {"ZT_DATA_DIR": str(tmp_path / "data"), "ZT_OUTPUT_DIR": str(tmp_path / "output")}
    code, _, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=str(a14b / "model"),
                                     ZT_EXPERT="low", **how)  # fmt: skip
    assert code == 0, err
    settings = Settings(expert="low")
    kind = families.get(FAMILY).configured(settings, a14b / "model")
    assert kind.denoiser == "transformer_2"
    pipe = DiffusionPipeline.from_pretrained(a14b / "model")
    objective = kind.objective(settings, pipe.scheduler, pipe.transformer_2.config)
    assert objective.describe().startswith("low-noise expert (transformer_2), sigmas in 0-0.9")
    assert kind.load_image_encoder(a14b / "model", torch.device("cpu")) is None
    _, pixels = demo_clips(a14b)
    encode = lambda px: kind.encode_latents(pipe.vae, px)  # noqa: E731
    assert set(kind.encode_conditions(pixels[:1], encode, None)) == {"condition_latents"}
    frames = i2v_clip(pipe, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()


@pytest.fixture(scope="module")
def ti2v(family_demo_dir, tmp_path_factory) -> Path:
    """The Wan demo as Wan 2.2 TI2V-5B: a WanPipeline whose model_index.json says
    `expand_timesteps`; data/ the Wan demo's."""
    demo = family_demo_dir("wan")
    root = tmp_path_factory.mktemp("ti2v")
    shutil.copytree(demo / "model", root / "model")
    index = json.loads((root / "model" / "model_index.json").read_text())
    (root / "model" / "model_index.json").write_text(json.dumps(index | {"expand_timesteps": True}))
    (root / "data").symlink_to(demo / "data")
    return root


def ti2v_clip(ti2v: Path) -> torch.Tensor:
    """One of the Wan demo's clips (1, 3, 9, 64, 64): its VAE folds 2 frames into one."""
    video = clips.Video(fps=16.0, frames=9, step=2)
    items = scan(ti2v / "data", log_skipped=False, video=video).items
    item = next(i for i in items if i.frames > 1)
    return torch.from_numpy(load_example(item, (64, 64, 9), flip=False).pixels)[None]


def test_ti2v_5b_trains_from_its_first_latent_frame_as_the_pipeline_samples(ti2v):
    """ZT_MODEL_FAMILY=wani2v on TI2V-5B (`expand_timesteps`): nothing cached beside the clip's
    latents (its first latent frame is the pipeline's condition: the VAE is causal), and the
    objective's prediction is the transformer on WanImageToVideoPipeline's input: the first
    latent frame clean, its tokens at timestep 0, the others at t."""
    from diffusers import WanImageToVideoPipeline

    assert families.detect_family(ti2v / "model") == "wan"  # read alone: text-to-video
    kind = families.get(FAMILY).configured(Settings(), ti2v / "model")
    assert kind.expand_timesteps and kind.latent_cache_tag() == ""
    pipe = WanImageToVideoPipeline.from_pretrained(ti2v / "model")
    clip = ti2v_clip(ti2v)
    latents = kind.encode_latents(pipe.vae, clip)
    assert kind.encode_conditions(clip, lambda px: kind.encode_latents(pipe.vae, px)) == {}
    _, condition, mask = pipe.prepare_latents(clip[:, :, 0], 1, 16, 64, 64, 9, torch.float32,
                                              torch.device("cpu"))  # fmt: skip
    torch.testing.assert_close(condition, latents[:, :, :1], atol=1e-4, rtol=1e-4)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert "first latent frame kept clean at timestep 0" in objective.describe()
    states = {"prompt_embeds": torch.randn(1, TOKENS, 64)}
    kwargs = kind.model_kwargs(states, torch.float32)
    noisy, sigmas = torch.randn_like(latents), torch.tensor([0.7])
    with torch.no_grad():
        ours = objective.predict(
            pipe.transformer, torch.cat([latents[:, :, :1], noisy[:, :, 1:]], dim=2), sigmas,
            kwargs, device=torch.device("cpu"), dtype=torch.float32,
        )  # fmt: skip
        t = sigmas * 1000
        theirs = pipe.transformer(
            hidden_states=(1 - mask) * condition + mask * noisy,
            timestep=(mask[0][0][:, ::2, ::2] * t).flatten()[None],
            encoder_hidden_states=kwargs["encoder_hidden_states"],
        ).sample  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_ti2v_5b_lora_samples_from_an_image(ti2v, tmp_path) -> None:
    """A LoRA of TI2V-5B trained image-to-video at ZeRO-3: the objective line says so, the
    validation clip is sampled from the first training clip's first frame through
    WanImageToVideoPipeline (the folder names WanPipeline), and the adapter loads there."""
    from diffusers import WanImageToVideoPipeline

    output = tmp_path / "output"
    log = run(tmp_path, ti2v, FAMILY, output=output, checkpoint_every_steps=0,
              validation_prompts=[PROMPT], validation_inference_steps=2, **LORA)  # fmt: skip
    assert "first latent frame kept clean at timestep 0" in log
    assert "samples: every prompt samples from the first frame of" in log
    (sheet,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert (output / "samples" / "base-vs-trained" / sheet.name).with_suffix(".mp4").is_file()
    pipe = WanImageToVideoPipeline.from_pretrained(ti2v / "model")
    image = first_frame(ti2v_clip(ti2v)[0])
    before = i2v_clip(pipe, image)
    pipe.load_lora_weights(output / "final")
    assert np.abs(i2v_clip(pipe, image) - before).max() > 1e-3, "the adapter changes nothing"


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    """Full fine-tuning at ZeRO-3 on 2 ranks, validation clips from the default input (the
    first training clip's first frame)."""
    return saved_run(tmp_path_factory, demo, FAMILY, eval_fraction=EVAL_FRACTION,
                     seed=held_out_seed(demo), **FULL)  # fmt: skip


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_exports_an_image_to_video_pipeline(demo, full_run) -> None:
    """ZeRO-3 on 2 ranks: every step logged with the image-to-video objective, the held-out
    clip's loss (ZT_EVAL_FRACTION) falls, final/ is a WanImageToVideoPipeline that renders a
    clip from an image; the validation clip was sampled from the first training clip's first
    frame (the log names it), shown input | base | trained as an mp4 and a contact sheet."""
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "first frame's latents and mask beside the noise" in log
    assert "samples: every prompt samples from the first frame of" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == "WanImageToVideoPipeline"
    assert json.loads((output / "run" / "eval.json").read_text())["held_out_images"] == 14
    held, _ = demo_clips(demo, held=True)
    assert len(held) == 1  # a clip never trained on: its loss falls too
    before = clip_loss(demo, base.transformer, draws=6, held=True)
    assert clip_loss(demo, final.transformer, draws=6, held=True) < 0.97 * before
    _, pixels = demo_clips(demo)
    frames = i2v_clip(final, first_frame(pixels[0]))
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    samples = output / "samples"
    (sheet,) = (samples / f"step-{STEPS}").glob("*.png")
    assert sheet.with_suffix(".mp4").is_file() and (samples / "inputs" / sheet.name).is_file()
    compared = samples / "base-vs-trained" / sheet.name
    assert compared.with_suffix(".mp4").is_file()
    from PIL import Image

    with Image.open(compared) as image:  # three rows: input, base, trained
        assert image.height >= 3 * 64


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank(demo, full_run, tmp_path) -> None:
    """From the step-5 checkpoint, 1 rank at ZeRO-2 trains steps 6-10 and exports
    WanImageToVideoPipeline folders."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, "WanImageToVideoPipeline")


def test_check_refuses_validation_images_as_train_does(demo_job_env, capsys):
    """Preflight's model step reads ZT_VALIDATION_IMAGES for every command: on SDXL, which
    samples from text alone, `check` exits 2 with the one line the ranks would give."""
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_VALIDATION_IMAGES", "first.png")
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "samples from its prompts alone" in line]
    assert len(lines) == 1 and "ZT_VALIDATION_IMAGES" in lines[0], out


@pytest.mark.slow
def test_a_missing_validation_image_is_one_line_before_training(demo, full_run, tmp_path):
    """ZT_VALIDATION_IMAGES naming a missing file, on the finished run's output: the rank exits
    2 with one line naming it, before training; the run's checkpoints and export are as they
    were."""
    output, _ = full_run
    latest = (output / "checkpoints" / "latest").read_text()
    final = {p.name: p.stat().st_mtime_ns for p in (output / "final").rglob("*")}
    missing = tmp_path / "missing.png"
    config = tk.ds_config(3, world=1, steps=STEPS + 2)
    job = tk.write_job(tmp_path / "job.json", model=demo / "model", deepspeed=config,
                       family=FAMILY, world=1)  # fmt: skip
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=tmp_path / "cache",
        max_steps=STEPS + 2, max_sequence_length=TOKENS, validation_prompts=[PROMPT],
        validation_images=str(missing),
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job, world=1)
    codes = {rank: s["exit_code"] for rank, s in tk.statuses(tmp_path).items()}
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "ZT_VALIDATION_IMAGES" in line and str(missing) in line]  # fmt: skip
    assert codes == {0: 2} and lines and "unreadable" in lines[0], proc.stderr[-3000:]
    assert (output / "checkpoints" / "latest").read_text() == latest
    assert {p.name: p.stat().st_mtime_ns for p in (output / "final").rglob("*")} == final


def test_validation_images_refusals_are_one_line(demo, tmp_path):
    """A file that is no image, a count that is neither 1 nor the prompts', and the setting
    for a model that samples from text alone: one line each; relative paths are read under
    ZT_DATA_DIR, one image serves every prompt."""
    from zerotuner.data.dataset import Dataset
    from zerotuner.errors import ConfigError
    from zerotuner.train import validation_inputs

    (tmp_path / "no.png").write_text("hello")
    empty = Dataset(tmp_path, [], [])
    frame = next(p.name for p in sorted((demo / "data").glob("*.png")))
    cases = (
        ({"validation_images": str(tmp_path / "no.png")}, "first frame", "not an image"),
        ({"validation_images": f"{frame},{frame},{frame}"}, "first frame", "3 images for 2"),
        ({"validation_images": frame}, "", "samples from its prompts alone"),
    )
    for given, takes, says in cases:
        settings = Settings(data_dir=str(demo / "data"), validation_prompts=["a", "b"], **given)
        with pytest.raises(ConfigError) as error:
            validation_inputs.chosen(settings, takes, empty, [])
        assert says in str(error.value) and "\n" not in str(error.value)
    settings = Settings(data_dir=str(demo / "data"), validation_prompts=["a", "b"],
                        validation_images=frame)  # fmt: skip
    first, second = validation_inputs.chosen(settings, "first frame", empty, [])
    assert first is second and first.mode == "RGB"


@pytest.mark.slow
def test_lora_at_zero_3_generates_from_an_image(demo, tmp_path) -> None:
    """A LoRA at ZeRO-3: `transformer.` keys that WanImageToVideoPipeline.load_lora_weights
    loads, lowering the clips' loss and changing the clip it renders from an image."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    log = run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=0, **LORA)
    assert "first frame's latents and mask beside the noise" in log
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    _, pixels = demo_clips(demo)
    image = first_frame(pixels[0])
    before, loss_before = i2v_clip(pipe, image), clip_loss(demo, pipe.transformer)
    pipe.load_lora_weights(final)
    assert clip_loss(demo, pipe.transformer) < 0.97 * loss_before
    assert np.abs(i2v_clip(pipe, image) - before).max() > 1e-3, "the adapter changes nothing"
