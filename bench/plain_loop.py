"""The plain training loop a user would write by hand: `python -m bench.plain_loop ...`.

One process, no DeepSpeed: load the SDXL pipeline with diffusers, encode the data folder's
images and captions once (VAE latents, both text encoders' embeddings, as diffusers' own SDXL
script precomputes them), then AdamW (torch's default implementation, or `--fused-adamw` its
fused kernel; same learning rate, betas, eps and weight decay as zerotuner's config; gradients
clipped to norm 1 as in both zerotuner's config and diffusers' scripts) on the UNet, the
pipeline's prediction type on its DDPM schedule, batches drawn in a seeded shuffle. fp32 on
the CPU (the default); `--device cuda --mixed-precision bf16` is diffusers' scripts' GPU
default (fp32 weights and optimizer, the forward under bf16 autocast). Writes step times,
losses and phase timestamps to --out as JSON. Eager: nothing compiled.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

STARTED = time.time()


def encode_data(pipe, data: Path, resolution: int, device: str):
    """Every image center-cropped to resolution, its latents and text embeddings (one pass)."""
    import numpy as np
    import torch
    from PIL import Image

    images = sorted(p for p in data.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg"})
    pixels, captions = [], []
    for path in images:
        image = Image.open(path).convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side)).resize((resolution,) * 2)
        pixels.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1)
        sidecar = path.with_suffix(".txt")
        captions.append(sidecar.read_text().strip() if sidecar.exists() else path.stem)
    with torch.no_grad():
        latents = pipe.vae.encode(torch.stack(pixels).to(device)).latent_dist.sample()
        latents = latents * pipe.vae.config.scaling_factor
        embeds, _, pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
    time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]] * len(images),
                            dtype=torch.float32, device=device)  # fmt: skip
    return latents, embeds, pooled, time_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused-adamw", action="store_true", help="torch's fused AdamW kernel")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    args = parser.parse_args()

    times = {"process_start": STARTED}
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    times["imported"] = time.time()
    pipe = StableDiffusionXLPipeline.from_pretrained(args.model).to(args.device)
    unet = pipe.unet  # trained with DDPM's schedule, as diffusers' own training scripts do
    scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")
    times["model_loaded"] = time.time()
    latents, embeds, pooled, time_ids = encode_data(pipe, args.data, args.resolution, args.device)
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16,
                              enabled=args.mixed_precision == "bf16")  # fmt: skip
    times["data_ready"] = time.time()
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=args.weight_decay,
                                  fused=args.fused_adamw or None)  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(latents), generator=gen)
    step_seconds, losses, at = [], [], 0
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        if at + args.batch > len(order):
            order, at = torch.randperm(len(latents), generator=gen), 0
        idx = order[at : at + args.batch].to(args.device)
        at += args.batch
        x = latents[idx]
        noise = torch.randn(x.shape, generator=gen).to(args.device)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (len(idx),), generator=gen)
        t = t.to(args.device)
        target = noise
        if scheduler.config.prediction_type == "v_prediction":
            target = scheduler.get_velocity(x, noise, t)
        with autocast:
            pred = unet(scheduler.add_noise(x, noise, t), t, embeds[idx],
                        added_cond_kwargs={"text_embeds": pooled[idx],
                                           "time_ids": time_ids[idx]}).sample  # fmt: skip
        loss = F.mse_loss(pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)  # diffusers' scripts' default
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the step's one device sync: its time includes the GPU's
        step_seconds.append(time.perf_counter() - started)
        if step == 1:
            times["first_step"] = time.time()
    times["end"] = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "step_seconds": step_seconds, "losses": losses, "times": times,
        "params": sum(p.numel() for p in unet.parameters()), "batch": args.batch,
        "threads": torch.get_num_threads(),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
