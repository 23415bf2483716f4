"""The demo: a tiny diffusion pipeline and a dataset it can learn, written without a download.

`make run` and the tests need a model with the exact layout and classes of a hub checkpoint
(so the same loading, caching, training and export code paths run), but small enough that a
2-rank CPU DeepSpeed step takes well under a second. Every component is a real diffusers /
transformers class with a tiny config, and the CLIP tokenizer's byte-level BPE vocabulary is
trained on the demo's own words (demo/parts.py). Everything is deterministic given the seed.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from PIL import Image, ImageDraw

from zerotuner.demo.parts import (
    DEMO_RESOLUTION,
    LATENT_SCALE,
    exact_vae,
    latent_scaling_factor,
    text_config,
    write_tokenizer,
)
from zerotuner.families import FLOW_FAMILIES, REGISTRY, Family
from zerotuner.families.registry import import_path
from zerotuner.settings.folders import readable_by_all

if TYPE_CHECKING:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import PreTrainedModel

RGB = tuple[int, int, int]

log = logging.getLogger(__name__)

DemoFamily = Family  # a key of families.REGISTRY

# their demo data holds clips too (demo/clips.py)
VIDEO_FAMILIES = tuple(f for f, spec in REGISTRY.items() if spec.video)
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (240, 210, 30)}  # fmt: skip
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}


@dataclass(frozen=True)
class DemoPaths:
    root: Path
    model: Path  # a diffusers pipeline folder (model_index.json at the top)
    data: Path  # images with sidecar .txt captions
    family: DemoFamily
    images: int


def write_demo(
    dir: Path, *, seed: int = 0, family: DemoFamily = "sdxl", images: int = 64
) -> DemoPaths:
    """Write DIR/model and DIR/data. Re-running overwrites only the files it writes."""
    dir = Path(dir)
    data = write_dataset(dir / "data", seed=seed, count=images)
    if family in VIDEO_FAMILIES:  # clips beside the images (each image a one-frame clip)
        write_clips(data)
    captions = [p.read_text() for p in sorted(data.glob("*.txt"))]
    model = _writer(family)(dir / "model", seed=seed, corpus=captions, data_dir=data)
    readable_by_all(model)  # a container's uid 1000 reads what root wrote here
    return DemoPaths(root=dir, model=model, data=data, family=family, images=images)


def _writer(family: DemoFamily) -> Callable[..., Path]:
    """What writes the family's tiny pipeline, called (model_dir, seed=, corpus=, data_dir=):
    its demo module's writer (its Spec's `demo`), else demo/flow.py's (SD3, Flux.1) or this
    module's (the UNet families)."""
    import importlib

    if REGISTRY[family].demo:
        module, function = REGISTRY[family].demo.split(":")
        return getattr(importlib.import_module(import_path(module, "zerotuner.demo")), function)
    if family in FLOW_FAMILIES:
        from zerotuner.demo.flow import write_flow_model

        return functools.partial(write_flow_model, family=family)
    return functools.partial(write_model, family=family)


# --- dataset ------------------------------------------------------------------------------


def write_dataset(data_dir: Path, *, seed: int = 0, count: int = 64) -> Path:
    """Coloured shapes on plain backgrounds with matching captions; a few are not square.

    Shape, colour and background vary independently and the caption names all three, so a
    tiny model's loss falls visibly and samples can be judged by eye.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    combos = [(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS]
    for i in range(count):
        shape, colour, background = combos[i % len(combos)]
        # Every 8th image is landscape, every 8th (offset 4) portrait: aspect buckets matter.
        size = (144, 96) if i % 8 == 3 else (96, 144) if i % 8 == 7 else (96, 96)
        image = draw_shape(rng, size, shape, COLOURS[colour], BACKGROUNDS[background])
        stem = data_dir / f"{i:03d}-{colour}-{shape}-on-{background}"
        image.save(stem.with_suffix(".png"), optimize=False)
        stem.with_suffix(".txt").write_text(f"a {colour} {shape} on a {background} background")
    return data_dir


# The video families' clips: a shape moving across a plain background, captioned as the
# images are plus which way it moves. PyAV (FFmpeg) writes H.264 .mp4, one .webm (VP8) and one
# .gif: the formats a clip folder holds. 9 frames at 16 fps: Wan's 4k+1 at the rate it samples.
CLIP_FRAMES, CLIP_FPS, CLIP_SIZE = 9, 16, 96
# (encoder, pixel format) by suffix: literal encoder names tell PyAV's types it is a video stream
CLIP_FORMATS: dict[str, tuple[Literal["libx264", "libvpx", "gif"], str]] = {
    ".mp4": ("libx264", "yuv420p"), ".webm": ("libvpx", "yuv420p"), ".gif": ("gif", "rgb8"),
}  # fmt: skip


def write_clips(data_dir: Path, *, count: int = 8) -> list[Path]:
    """`count` captioned clips in data_dir (beside the demo images); the last two are a .webm
    and a .gif."""
    data_dir.mkdir(parents=True, exist_ok=True)
    combos = [(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS]
    written = []
    for i in range(count):
        shape, colour, background = combos[(i * 7) % len(combos)]
        direction = "right" if i % 2 == 0 else "left"
        suffix = ".gif" if i == count - 1 else ".webm" if i == count - 2 else ".mp4"
        stem = data_dir / f"clip-{i:02d}-{colour}-{shape}-moving-{direction}"
        frames = [_clip_frame(k, shape, COLOURS[colour], BACKGROUNDS[background], direction)
                  for k in range(CLIP_FRAMES)]  # fmt: skip
        written.append(_encode_clip(frames, stem.with_suffix(suffix)))
        caption = f"a {colour} {shape} moving {direction} on a {background} background"
        stem.with_suffix(".txt").write_text(caption)
    return written


def _clip_frame(k: int, shape: str, fill: RGB, background: RGB, direction: str) -> np.ndarray:
    image = Image.new("RGB", (CLIP_SIZE, CLIP_SIZE), background)
    draw = ImageDraw.Draw(image)
    r = CLIP_SIZE * 3 // 10
    travel = (CLIP_SIZE - 2 * r) * k // (CLIP_FRAMES - 1)
    cx = r + (travel if direction == "right" else CLIP_SIZE - 2 * r - travel)
    _draw(draw, shape, (cx, CLIP_SIZE // 2), r, fill)
    return np.asarray(image)


def _encode_clip(frames: list[np.ndarray], path: Path) -> Path:
    import av

    codec, pixel_format = CLIP_FORMATS[path.suffix]
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(codec, rate=CLIP_FPS)
        stream.width, stream.height, stream.pix_fmt = CLIP_SIZE, CLIP_SIZE, pixel_format
        # one encoder thread: the bytes (so the content digests, hence which clips a held-out
        # fraction picks) are the same on every machine, whatever its core count
        stream.codec_context.thread_count = 1
        if codec == "libx264":
            stream.options = {"crf": "18"}  # the shapes' edges stay sharp
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def draw_shape(
    rng: random.Random, size: tuple[int, int], shape: str, fill: RGB, background: RGB
) -> Image.Image:
    """One big shape near the centre: a 4-million-parameter UNet learns it in a few hundred steps
    (small shapes anywhere in the frame take thousands)."""
    w, h = size
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    side = min(w, h)
    r = rng.randint(side * 30 // 100, side * 35 // 100)
    jitter = side // 16
    centre = (w // 2 + rng.randint(-jitter, jitter), h // 2 + rng.randint(-jitter, jitter))
    _draw(draw, shape, centre, r, fill)
    return image


def _draw(
    draw: ImageDraw.ImageDraw, shape: str, centre: tuple[int, int], r: int, fill: RGB
) -> None:
    """A circle, square or triangle of radius r around centre."""
    cx, cy = centre
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


# --- model ----------------------------------------------------------------------------------


def _unet(
    seed: int, *, cross_attention_dim: int, sdxl: bool, pooled_dim: int = 0, linear: bool = True
) -> UNet2DConditionModel:
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    extra = {}
    if sdxl:
        time_dim = 8
        extra = {
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": time_dim,
            # 6 micro-conditioning numbers (original size, crop, target size), each embedded.
            "projection_class_embeddings_input_dim": 6 * time_dim + pooled_dim,
        }
    return UNet2DConditionModel(
        sample_size=DEMO_RESOLUTION // LATENT_SCALE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        cross_attention_dim=cross_attention_dim,
        use_linear_projection=linear,  # SD 1.x projects with 1x1 convolutions
        norm_num_groups=32,
        **extra,
    )


def _scheduler(family: DemoFamily) -> EulerDiscreteScheduler:
    from diffusers import EulerDiscreteScheduler

    # SD 1.x keeps the published epsilon schedule and SD 2.x (768 px) predicts v. The SDXL demo
    # predicts v on a zero-terminal-SNR schedule (arXiv 2305.08891): sampling starts from the
    # pure noise training saw at t=999, so a tiny UNet gets the background colour right within
    # `make run`'s steps; the epsilon schedule's leak of signal at t=999 leaves it grey.
    zero_snr = family == "sdxl"
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="trailing" if zero_snr else "leading",
        steps_offset=0 if zero_snr else 1,
        rescale_betas_zero_snr=zero_snr,
        prediction_type="epsilon" if family == "sd1" else "v_prediction",
    )


WORD_EMBEDDING_SCALE = 50.0


def _distinct_words(*text_encoders: PreTrainedModel) -> None:
    """Scale the token embeddings so a word outweighs its position and the random layers.

    A freshly initialised CLIP encoder maps "a red circle ..." and "a blue circle ..." to
    nearly the same states (embeddings and positions share one small std), so the UNet could
    not tell the prompts apart; a trained CLIP tells them apart, and so does this one.
    """
    import torch

    with torch.no_grad():
        for encoder in text_encoders:
            embedding = encoder.get_input_embeddings()
            assert isinstance(embedding, torch.nn.Embedding)  # the token table: one row a token
            embedding.weight.mul_(WORD_EMBEDDING_SCALE)


def write_model(
    model_dir: Path, *, family: DemoFamily, seed: int, corpus: list[str], data_dir: Path
) -> Path:
    """Build the tiny pipeline from the real classes and `save_pretrained` it like a hub model."""
    import shutil
    import tempfile

    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    bpe_files = Path(tempfile.mkdtemp(prefix="zerotuner-bpe-"))
    tokenizer = write_tokenizer(bpe_files, corpus)
    vocab_size = len(tokenizer)
    vae = exact_vae(seed)
    vae.register_to_config(scaling_factor=latent_scaling_factor(vae, data_dir))
    scheduler = _scheduler(family)

    if family == "sdxl":
        torch.manual_seed(seed + 1)
        text_encoder = CLIPTextModel(text_config(vocab_size, 32))
        torch.manual_seed(seed + 2)
        text_encoder_2 = CLIPTextModelWithProjection(text_config(vocab_size, 32))
        _distinct_words(text_encoder, text_encoder_2)
        unet = _unet(seed + 3, cross_attention_dim=32 + 32, sdxl=True, pooled_dim=32)
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
    else:
        # SD 2.x attends to OpenCLIP-H's 1024-wide states; family detection keys on that width.
        hidden = 1024 if family == "sd2" else 32
        torch.manual_seed(seed + 1)
        text_encoder = CLIPTextModel(
            text_config(vocab_size, hidden, layers=1 if family == "sd2" else 2, heads=4)
        )
        unet = _unet(seed + 3, cross_attention_dim=hidden, sdxl=False, linear=family == "sd2")
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(model_dir, safe_serialization=True)
    # transformers 5 saves tokenizer.json only; 4.x's slow CLIPTokenizer needs these two.
    for sub in ("tokenizer", "tokenizer_2") if family == "sdxl" else ("tokenizer",):
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(bpe_files / name, model_dir / sub / name)
    shutil.rmtree(bpe_files, ignore_errors=True)
    return model_dir
