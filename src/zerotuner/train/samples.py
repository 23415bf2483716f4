"""Validation images: the current UNet in the base pipeline, fixed prompts and seeds.

Works at every ZeRO stage: the caller gathers the full weights on rank 0 (every rank takes
part in the gather, see ema.full_state_dict) and rank 0 renders them here, in a fresh UNet, so
DeepSpeed's partitioning hooks never run inside the pipeline. The frozen parts are read again
from the base folder (they left memory after caching) and dropped afterwards.

After each validation, samples/base-vs-trained.png sets the base model's images (same prompts,
same seeds; rendered once into samples/base/) above the latest ones, so what training changed
is one look away.
"""

from __future__ import annotations

import json
import logging
import re
import textwrap
from pathlib import Path

import torch

log = logging.getLogger(__name__)

COMPARISON = "base-vs-trained.png"


def load_pipeline(
    base: Path,
    unet_state: dict[str, torch.Tensor] | None,
    *,
    device: str,
    lora_dir: Path | None = None,
) -> object:
    """`unet_state`: the trained denoiser's weights (UNet or transformer), None for the base's
    as saved; `lora_dir`: a LoRA adapter loaded on top."""
    from diffusers import DiffusionPipeline

    from zerotuner.weights.pipeline_folder import built_part, denoiser_part

    parts = {}
    if unet_state is not None:
        part = denoiser_part(base)
        parts[part] = built_part(base, part, unet_state)
    pipe = DiffusionPipeline.from_pretrained(base, dtype=torch.float32, **parts)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
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
    resolution: int,
    inference_steps: int,
    seed: int,
    device: str = "cpu",
    lora_dir: Path | None = None,
    guidance_scale: float | None = None,
    compare: bool = True,
    pipeline_kwargs: dict | None = None,
) -> list[Path]:
    """One image per prompt, prompt i with seed + i, into out_dir (e.g. samples/step-N/);
    then (compare) the side-by-side with the base model's images in out_dir's parent.
    guidance_scale None: the pipeline's default (SDXL 5, SD 7.5). `pipeline_kwargs`: the
    family's own (the T5 length it trained with)."""
    extra = {} if guidance_scale is None else {"guidance_scale": guidance_scale}
    extra |= pipeline_kwargs or {}
    pipe = load_pipeline(base, unet_state, device=device, lora_dir=lora_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed + i)
        out = pipe(
            prompt=prompt,  # by name: FLUX.2's pipelines take reference images first
            height=resolution,
            width=resolution,
            num_inference_steps=inference_steps,
            generator=generator,
            **extra,
        )
        # a video pipeline's (Wan's) first clip's first frame: it renders one-frame clips
        image = out.frames[0][0] if not hasattr(out, "images") else out.images[0]
        path = out_dir / f"{i:02d}-{slug(prompt)}.png"
        image.save(path)
        written.append(path)
    (out_dir / "prompts.txt").write_text(
        "".join(f"{seed + i}\t{p}\n" for i, p in enumerate(prompts))
    )
    del pipe
    log.info("samples: %d image(s) in %s", len(written), out_dir)
    if compare:
        try:
            base_images = _base_samples(
                base, prompts, out_dir.parent / "base", resolution=resolution,
                inference_steps=inference_steps, seed=seed, device=device,
                guidance_scale=guidance_scale, pipeline_kwargs=pipeline_kwargs,
            )  # fmt: skip
            side_by_side(
                [("base model", base_images), (out_dir.name.replace("-", " "), written)],
                prompts,
                out_dir.parent / COMPARISON,
            )
        except Exception as error:  # noqa: BLE001 - a nicety must not end a training run
            log.warning("samples: no side-by-side with the base model: %s", error)
    return written


def _base_samples(base: Path, prompts: list[str], out_dir: Path, **how) -> list[Path]:
    """The base model's samples, rendered once per base, prompts and settings (a resumed or
    repeated run reuses them)."""
    key = {"base": str(base), "prompts": prompts, **how}
    key.pop("device")
    stamp = out_dir / "render.json"
    paths = [out_dir / f"{i:02d}-{slug(p)}.png" for i, p in enumerate(prompts)]
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
