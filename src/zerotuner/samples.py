"""Validation images: the current UNet in the base pipeline, fixed prompts and seeds.

Works at every ZeRO stage: the caller gathers the full weights on rank 0 (every rank takes
part in the gather, see ema.full_state_dict) and rank 0 renders them here, in a fresh UNet, so
DeepSpeed's partitioning hooks never run inside the pipeline. The frozen parts are read again
from the base folder (they left memory after caching) and dropped afterwards.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def load_pipeline(
    base: Path,
    unet_state: dict[str, torch.Tensor] | None,
    *,
    device: str,
    lora_dir: Path | None = None,
) -> object:
    """`unet_state` None: the base UNet as saved; `lora_dir`: a LoRA adapter loaded on top."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    parts = {}
    if unet_state is not None:
        unet = UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(base, subfolder="unet")
        )
        unet.load_state_dict(unet_state)
        parts["unet"] = unet
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
) -> list[Path]:
    """One image per prompt, prompt i with seed + i, into out_dir (e.g. samples/step-N/)."""
    pipe = load_pipeline(base, unet_state, device=device, lora_dir=lora_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed + i)
        image = pipe(
            prompt,
            height=resolution,
            width=resolution,
            num_inference_steps=inference_steps,
            generator=generator,
        ).images[0]
        path = out_dir / f"{i:02d}-{slug(prompt)}.png"
        image.save(path)
        written.append(path)
    (out_dir / "prompts.txt").write_text(
        "".join(f"{seed + i}\t{p}\n" for i, p in enumerate(prompts))
    )
    del pipe
    log.info("samples: %d image(s) in %s", len(written), out_dir)
    return written
