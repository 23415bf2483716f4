"""Validation images: the current UNet in the base pipeline, fixed prompts and seeds.

Works at every ZeRO stage: the caller gathers the full weights on rank 0 (every rank takes
part in the gather, see ema.full_state_dict) and rank 0 renders them here, in a fresh UNet, so
DeepSpeed's partitioning hooks never run inside the pipeline. The frozen parts are read again
from the base folder (they left memory after caching) and dropped afterwards. A LoRA trained on
a base stored in 8 bits (ZT_BASE_PRECISION) renders on the base stored so, as it trains.

After each validation, samples/base-vs-trained.png sets the base model's images (same prompts,
same seeds; rendered once into samples/base/) above the latest ones, so what training changed
is one look away.

A video family's pipeline (Wan) renders clips instead: per prompt NN-slug.mp4 (H.264, yuv420p,
at ZT_VIDEO_FPS) and NN-slug.png, a contact sheet of evenly spaced frames; the comparison is
samples/base-vs-trained/NN-slug.mp4 (the base model's clip beside the trained one) and its
contact sheet NN-slug.png (base row above trained row).

A model that samples from an input image (Wan image-to-video, FLUX.1 Kontext: `inputs`, one per
prompt, train/validation_inputs.py; Qwen-Image-Edit Plus: a list of references) gets it as the
pipeline's `image`; the inputs are saved once as samples/inputs/NN-slug.png (references side by
side) and head the comparisons (input | base | trained: the image grid's
first row, the clip comparison's first column, the still image held for the clip's length).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import textwrap
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

log = logging.getLogger(__name__)

COMPARISON = "base-vs-trained.png"
CLIP_COMPARISONS = "base-vs-trained"  # the folder of a video family's per-prompt comparisons
VIDEO_FPS = 16.0  # ZT_VIDEO_FPS's default, for callers that pass none
# Frames of a validation clip: ZT_VIDEO_FRAMES, at most MAX_SAMPLE_FRAMES. The validation
# settings (prompts x ZT_VALIDATION_INFERENCE_STEPS at the bucket's resolution) already set
# what an image sample costs; a clip multiplies that by its latent frames (Wan's VAE packs 4
# frames into one) and attention over them grows faster still. 33 frames are 2 s at Wan 2.1's
# 16 fps and 9 latent frames against 81 frames' 21: enough to see motion, a fraction of a full
# clip's time, and it keeps the base model's clips (rendered once) cheap too.
MAX_SAMPLE_FRAMES = 33
SHEET_FRAMES = 8  # frames on a contact sheet, evenly spaced from first to last
SHEET_COLUMNS = 4
SHEET_SIDE = 384  # a larger frame is shrunk to this (its longer side) on a contact sheet


def load_pipeline(
    base: Path,
    unet_state: dict[str, torch.Tensor] | None,
    *,
    family: str,
    device: str,
    lora_dir: Path | None = None,
    denoiser: str | None = None,
    base_precision: str = "auto",
    pipeline: type | None = None,
) -> Any:
    """`base`, a pipeline folder of `family`, opened as the family opens it
    (`ModelFamily.open_pipeline`); `unet_state`: the trained denoiser's weights (UNet or
    transformer; `denoiser`: the part they are, Wan 2.2 A14B's expert), None for the base's as
    saved; `lora_dir`: a LoRA adapter loaded on top (into `transformer_2` for A14B's low-noise
    expert), on the base stored at `base_precision` as the run trained it (ZT_BASE_PRECISION);
    `pipeline`: the class to load the folder as, when not the one its model_index.json names
    (Wan 2.2 TI2V-5B's WanPipeline folder sampled from an image by WanImageToVideoPipeline)."""
    from zerotuner import families
    from zerotuner.weights import base_precision as stored
    from zerotuner.weights.pipeline_folder import built_part, denoiser_part

    parts = {}
    part = denoiser or denoiser_part(base)
    if unet_state is not None:
        parts[part] = built_part(base, part, unet_state)
    pipe = families.get(family).open_pipeline(base, pipeline, dtype=torch.float32, **parts)
    if stored.is_low(base_precision):
        stored.quantize_frozen_base(getattr(pipe, part), base_precision)
    if lora_dir is not None:
        into = {"load_into_transformer_2": True} if part == "transformer_2" else {}
        pipe.load_lora_weights(lora_dir, **into)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:48] or "prompt"


def render(
    base: Path,
    unet_state: dict[str, torch.Tensor] | None,
    prompts: list[str],
    out_dir: Path,
    *,
    family: str,
    resolution: int,
    inference_steps: int,
    seed: int,
    device: str = "cpu",
    lora_dir: Path | None = None,
    guidance_scale: float | None = None,
    compare: bool = True,
    pipeline_kwargs: dict[str, Any] | None = None,
    video_frames: int | None = None,
    video_fps: float | None = None,
    denoiser: str | None = None,
    base_precision: str = "auto",
    inputs: list[PILImage | list[PILImage]] | None = None,
    pipeline: type | None = None,
) -> list[Path]:
    """One image per prompt, prompt i with seed + i, into out_dir (e.g. samples/step-N/);
    then (compare) the side-by-side with the base model's images in out_dir's parent.
    guidance_scale None: the pipeline's default (SDXL 5, SD 7.5). `pipeline_kwargs`: the
    family's own (the T5 length it trained with).

    A video pipeline (its call takes `num_frames`) renders a clip per prompt instead, of
    `sample_frames(video_frames)` frames (whatever num_frames pipeline_kwargs names), written
    as NN-slug.mp4 at `video_fps` (ZT_VIDEO_FPS; None: 16) beside its contact sheet NN-slug.png;
    the .mp4 paths are returned. `family`, `denoiser`, `base_precision`: base's family, the
    trained part and how the run stores the base (load_pipeline); the base model's own images
    use its weights as saved."""
    extra: dict[str, Any] = {} if guidance_scale is None else {"guidance_scale": guidance_scale}
    extra |= pipeline_kwargs or {}
    pipe = load_pipeline(
        base, unet_state, family=family, device=device, lora_dir=lora_dir, denoiser=denoiser,
        base_precision=base_precision, pipeline=pipeline,
    )  # fmt: skip
    takes = inspect.signature(pipe.__call__).parameters
    if "guidance_scale" in extra and "guidance_scale" not in takes:  # HunyuanVideo 1.5's guider
        pipe.guider = pipe.guider.new(guidance_scale=extra.pop("guidance_scale"))
    video = "num_frames" in takes
    fps = VIDEO_FPS if video_fps is None else video_fps
    if video:
        temporal = int(
            getattr(pipe, "vae_scale_factor_temporal", None)  # Wan's; LTX-2's:
            or getattr(pipe, "vae_temporal_compression_ratio", 1)
            or 1
        )
        extra |= {"num_frames": sample_frames(video_frames, temporal), "output_type": "np"}
    how = {"num_inference_steps": inference_steps}
    if "height" in takes:  # HunyuanVideo 1.5 I2V's sizes the clip by its input image
        how |= {"height": resolution, "width": resolution}
    written = _render_each(pipe, prompts, out_dir, seed=seed, fps=fps if video else None,
                           call=how | extra, inputs=inputs)  # fmt: skip
    del pipe
    log.info("samples: %d %s in %s", len(written), "clip(s)" if video else "image(s)", out_dir)
    if compare:
        try:
            base_samples = _base_samples(
                base, prompts, out_dir.parent / "base", family=family, resolution=resolution,
                inference_steps=inference_steps, seed=seed, device=device,
                guidance_scale=guidance_scale, pipeline_kwargs=pipeline_kwargs,
                **({"video_frames": video_frames, "video_fps": fps} if video else {}),
                inputs=inputs, pipeline=pipeline,
            )  # fmt: skip
            shown = save_inputs(inputs, prompts, out_dir.parent / "inputs") if inputs else None
            _compare(base_samples, written, prompts, out_dir, fps=fps if video else None,
                     inputs=shown)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a nicety must not end a training run
            log.warning("samples: no side-by-side with the base model: %s", error)
    return written


def _render_each(
    pipe: Any, prompts: list[str], out_dir: Path, *, seed: int, fps: float | None,
    call: dict[str, Any], inputs: list[PILImage | list[PILImage]] | None = None,
) -> list[Path]:  # fmt: skip
    """Prompt i with seed + i through `pipe` into out_dir (with prompts.txt naming the seeds);
    `fps`: a video pipeline's clips, written at that rate beside their contact sheets;
    `inputs`: prompt i's input image (or images), the pipeline's `image`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed + i)
        image = {"image": inputs[i]} if inputs else {}
        # the prompt by name: FLUX.2's pipelines take reference images first
        out = pipe(prompt=prompt, generator=generator, **image, **call)
        path = out_dir / f"{i:02d}-{slug(prompt)}.png"
        if fps is not None:  # the mp4 first: the run page shows a clip once its sheet is there
            frames = as_uint8(out.frames[0])
            written.append(write_clip(frames, path.with_suffix(".mp4"), fps))
            contact_sheet(frames, path)
        else:
            out.images[0].save(path)
            written.append(path)
    (out_dir / "prompts.txt").write_text(
        "".join(f"{seed + i}\t{p}\n" for i, p in enumerate(prompts))
    )
    return written


def _compare(
    base: list[Path], trained: list[Path], prompts: list[str], out_dir: Path, *,
    fps: float | None, inputs: list[Path] | None = None,
) -> None:  # fmt: skip
    """The base model's samples beside the trained ones, in out_dir's parent: one image grid,
    or (`fps`: clips) a side-by-side clip per prompt; `inputs` (saved input images) first."""
    label = out_dir.name.replace("-", " ")
    if fps is None:
        grid = [("input image", inputs)] if inputs else []
        side_by_side([*grid, ("base model", base), (label, trained)], prompts,
                     out_dir.parent / COMPARISON)  # fmt: skip
        return
    for n, (base_clip, clip) in enumerate(zip(base, trained, strict=True)):
        base_frames, frames = read_clip(base_clip), read_clip(clip)
        held = [("input image", still(inputs[n], base_frames))] if inputs else []
        clips_side_by_side(
            [*held, ("base model", base_frames), (label, frames)],
            out_dir.parent / CLIP_COMPARISONS / clip.name,
            fps,
        )


def save_inputs(
    inputs: list[PILImage | list[PILImage]], prompts: list[str], folder: Path
) -> list[Path]:
    """Each prompt's input image as folder/NN-slug.png (what the comparisons show; several
    references side by side)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (image, prompt) in enumerate(zip(inputs, prompts, strict=True)):
        path = folder / f"{i:02d}-{slug(prompt)}.png"
        joined(image).save(path)
        paths.append(path)
    return paths


def joined(images: PILImage | list[PILImage]) -> PILImage:
    """An input image, or several references side by side at the first one's height."""
    from PIL import Image

    if not isinstance(images, list):
        return images
    height = images[0].height
    sized = [i.resize((max(1, round(i.width * height / i.height)), height)) for i in images]
    out = Image.new("RGB", (sum(i.width for i in sized), height))
    for n, image in enumerate(sized):
        out.paste(image, (sum(i.width for i in sized[:n]), 0))
    return out


def still(path: Path, frames: np.ndarray) -> np.ndarray:
    """An input image as a clip of `frames`' length and size (frames, h, w, 3) uint8."""
    from PIL import Image

    with Image.open(path) as image:
        size = (frames.shape[2], frames.shape[1])
        array = np.asarray(image.convert("RGB").resize(size, Image.Resampling.LANCZOS))
    return np.repeat(array[None], len(frames), axis=0)


def _base_samples(base: Path, prompts: list[str], out_dir: Path, **how: Any) -> list[Path]:
    """The base model's samples, rendered once per base, prompts and settings (a resumed or
    repeated run reuses them)."""
    key = {"base": str(base), "prompts": prompts, **how}
    key.pop("device")
    if key.get("inputs"):  # the same input images: their pixels' digest
        import hashlib

        key["inputs"] = [hashlib.sha256(joined(i).tobytes()).hexdigest()[:16]
                         for i in key["inputs"]]  # fmt: skip
    else:
        key.pop("inputs", None)
    key["pipeline"] = getattr(key.get("pipeline"), "__name__", None)
    if key["pipeline"] is None:
        key.pop("pipeline")
    stamp = out_dir / "render.json"
    paths = [out_dir / f"{i:02d}-{slug(p)}.png" for i, p in enumerate(prompts)]
    if "video_frames" in how:  # a video family's: the clips beside their contact sheets
        paths = [p.with_suffix(".mp4") for p in paths]
    if stamp.is_file() and json.loads(stamp.read_text()) == key and all(p.is_file() for p in paths):
        return paths
    written = render(base, None, prompts, out_dir, compare=False, **how)
    stamp.write_text(json.dumps(key))
    return written


def side_by_side(rows: list[tuple[str, list[Path]]], prompts: list[str], out: Path) -> Path:
    """A labelled grid: one column per prompt, one row per (label, images)."""
    from PIL import Image, ImageDraw, ImageFont

    with Image.open(rows[0][1][0]) as first:
        side = max(first.size)
    # Small samples are enlarged by a whole factor (crisp pixels), large ones shrunk.
    cell = side * max(1, 256 // side) if side < 256 else min(side, 512)
    font = ImageFont.load_default(size=14)
    line = 18
    chars = max(8, int(cell / font.getlength("x")) - 1)
    wrapped = [textwrap.wrap(p, chars, max_lines=3, placeholder=" ...") or [""] for p in prompts]
    top = line * max(len(w) for w in wrapped) + 8
    left = max(int(font.getlength(label)) for label, _ in rows) + 16
    sheet = Image.new("RGB", (left + cell * len(prompts), top + cell * len(rows)), "white")
    draw = ImageDraw.Draw(sheet)
    for col, lines in enumerate(wrapped):
        for n, text in enumerate(lines):
            draw.text((left + col * cell + 4, 4 + n * line), text, fill="black", font=font)
    for row, (label, paths) in enumerate(rows):
        y = top + row * cell
        draw.text((6, y + cell // 2 - line // 2), label, fill="black", font=font)
        for col, path in enumerate(paths):
            with Image.open(path) as image:
                scaled = image.convert("RGB").resize(
                    (cell, cell),
                    Image.Resampling.NEAREST if cell >= side else Image.Resampling.LANCZOS,
                )
            sheet.paste(scaled, (left + col * cell, y))
    sheet.save(out)
    log.info("samples: base model vs %s side by side in %s", rows[-1][0], out)
    return out


# --- clips (video families) -------------------------------------------------------------------


def sample_frames(requested: int | None, temporal: int = 1) -> int:
    """Frames of a validation clip: ZT_VIDEO_FRAMES (None: as many as allowed), at most
    MAX_SAMPLE_FRAMES, rounded down to the model's rule (k * temporal + 1: Wan's 4k+1)."""
    frames = MAX_SAMPLE_FRAMES if requested is None else min(requested, MAX_SAMPLE_FRAMES)
    temporal = max(1, temporal)
    return max(1, (frames - 1) // temporal * temporal + 1)


def as_uint8(clip: object) -> np.ndarray:
    """A pipeline's clip (frames, height, width, 3), floats in [0, 1] or PIL images, as uint8."""
    if isinstance(clip, list | tuple):
        return np.stack([np.asarray(frame.convert("RGB")) for frame in clip])
    array = np.asarray(clip)
    if array.dtype == np.uint8:
        return array
    return (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)


def video_codec() -> str:
    """H.264 (libx264, else OpenH264) where the bundled FFmpeg has an encoder for it: every
    browser plays it; else MPEG-4 part 2 (players such as VLC and ffplay do, browsers don't)."""
    import av

    for name in ("libx264", "libopenh264"):
        if name in av.codecs_available:
            try:
                av.Codec(name, "w")
                return name
            except (ValueError, av.FFmpegError):
                continue
    return "mpeg4"


def write_clip(frames: np.ndarray, path: Path, fps: float) -> Path:
    """frames (n, height, width, 3) uint8 as an .mp4 at `fps`: yuv420p, odd sides padded by
    repeating the last row/column, the index up front (faststart) so a browser starts at once.
    Written beside and renamed into place: a reader never sees half a file."""
    import av

    frames = np.asarray(frames, dtype=np.uint8)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    codec = video_codec()
    partial = path.with_name(f".{path.name}.part")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(partial), "w", format="mp4", options={"movflags": "+faststart"}) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        assert isinstance(stream, av.VideoStream)  # each of video_codec()'s is a video codec
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18", "preset": "medium"}
        elif codec == "mpeg4":
            stream.options = {"qscale": "3"}
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    os.replace(partial, path)
    return path


def read_clip(path: Path) -> np.ndarray:
    """An .mp4's frames (n, height, width, 3) uint8."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def spaced(count: int, wanted: int = SHEET_FRAMES) -> list[int]:
    """Up to `wanted` frame indices, evenly spaced from the first to the last."""
    return sorted({round(i) for i in np.linspace(0, count - 1, min(count, wanted))})


def _cell(frames: np.ndarray) -> int:
    """A frame's scale on a sheet or a comparison: small clips enlarged by a whole factor."""
    side = max(frames.shape[1:3])
    return max(1, 256 // side) if side < 256 else 1


def _sheet_frame(frame: np.ndarray) -> PILImage:
    """A frame as a PIL image for a contact sheet: its longer side at most SHEET_SIDE."""
    from PIL import Image

    image = Image.fromarray(frame)
    side = max(image.size)
    if side <= SHEET_SIDE:
        return image
    size = (round(image.width * SHEET_SIDE / side), round(image.height * SHEET_SIDE / side))
    return image.resize(size, Image.Resampling.LANCZOS)


def contact_sheet(
    frames: np.ndarray, path: Path, *, wanted: int = SHEET_FRAMES, columns: int = SHEET_COLUMNS
) -> Path:
    """Evenly spaced frames of a clip in a grid, row by row, 2 white pixels apart."""
    from PIL import Image

    chosen = [_sheet_frame(frames[i]) for i in spaced(len(frames), wanted)]
    columns = min(columns, len(chosen))
    rows = -(-len(chosen) // columns)
    width, height = chosen[0].size
    gap = 2
    sheet = Image.new(
        "RGB", (columns * width + (columns - 1) * gap, rows * height + (rows - 1) * gap), "white"
    )
    for n, frame in enumerate(chosen):
        row, col = divmod(n, columns)
        sheet.paste(frame, (col * (width + gap), row * (height + gap)))
    sheet.save(path)
    return path


def clips_side_by_side(rows: list[tuple[str, np.ndarray]], out: Path, fps: float) -> Path:
    """Clips of one prompt, labelled and side by side, as out (.mp4) and its contact sheet
    (.png, a row of evenly spaced frames per clip, labels on the left). Small clips are enlarged
    by a whole factor (crisp pixels); the shorter clip sets the length."""
    from PIL import Image, ImageDraw, ImageFont

    length = min(len(frames) for _, frames in rows)
    scale = _cell(rows[0][1])
    clips = [np.asarray(f[:length]) for _, f in rows]
    if scale > 1:
        clips = [c.repeat(scale, axis=1).repeat(scale, axis=2) for c in clips]
    height = max(c.shape[1] for c in clips)
    font = ImageFont.load_default(size=14)
    top, gap = 20, 4
    widths = [c.shape[2] for c in clips]
    canvas = Image.new("RGB", (sum(widths) + gap * (len(clips) - 1), top + height), "white")
    draw = ImageDraw.Draw(canvas)
    x = 0
    for (label, _), width in zip(rows, widths, strict=True):
        draw.text((x + 4, 2), label, fill="black", font=font)
        x += width + gap
    header = np.asarray(canvas).copy()
    composite = np.repeat(header[None], length, axis=0)
    x = 0
    for clip in clips:
        composite[:, top : top + clip.shape[1], x : x + clip.shape[2]] = clip
        x += clip.shape[2] + gap
    out.parent.mkdir(parents=True, exist_ok=True)
    write_clip(composite, out.with_suffix(".mp4"), fps)

    # The sheet: a row per clip, the same evenly spaced frames in each.
    picked = spaced(length)
    left = max(int(font.getlength(label)) for label, _ in rows) + 12
    cell_w, cell_h = _sheet_frame(clips[0][0]).size
    sheet = Image.new(
        "RGB", (left + len(picked) * (cell_w + 2), len(clips) * (cell_h + 2)), "white"
    )
    draw = ImageDraw.Draw(sheet)
    for row, ((label, _), clip) in enumerate(zip(rows, clips, strict=True)):
        y = row * (cell_h + 2)
        draw.text((6, y + cell_h // 2 - 9), label, fill="black", font=font)
        for col, i in enumerate(picked):
            sheet.paste(_sheet_frame(clip[i]), (left + col * (cell_w + 2), y))
    sheet.save(out.with_suffix(".png"))
    log.info("samples: base model vs %s side by side in %s", rows[-1][0], out.with_suffix(".mp4"))
    return out.with_suffix(".mp4")
