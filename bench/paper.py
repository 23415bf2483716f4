"""The GPU picture on paper: what zerotuner would choose for the seed's headline run (SDXL,
1024^2, batch 8, one 24 GB RTX 4090; the seed measured 13.1 GB and 8 s/it) and an estimate
of each part of one step. Everything here is an ESTIMATE: the planner's formulas, FLOPs
counted on the meta device, an assumed GPU utilisation and PCIe rate, and CPU Adam's speed
measured on this machine's cores, scaled to an assumed desktop CPU.

Beside it the same job as LoRA (rank 16 on the attention layers, ZT_LORA_*'s defaults): what
the planner picks with the base frozen, its memory, and a step from FLOPs counted with the
adapter in place (backward computes no weight gradients for the frozen base).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

GiB = 1 << 30
GPU_NAME = "NVIDIA GeForce RTX 4090"
GPU_MEMORY = 24 * GiB  # 24564 MiB in nvidia-smi; 24 GiB is close enough for a plan
GPU_BF16_TFLOPS = 165.2  # dense bf16 tensor cores, fp32 accumulate (Ada whitepaper)
ASSUMED_MFU = 0.45  # a UNet's convolutions and attention at 1024^2 in bf16, no compile
PCIE_BYTES_PER_S = 20e9  # PCIe 4.0 x16, ~25 GB/s peak; pinned-memory copies reach ~20
ASSUMED_HOST_CORES = 16  # a 4090 desktop; CPU Adam scales with cores (memory-bound later)
HOST_MEMORY = 64 * GiB
LORA_RANK = 16  # ZT_LORA_RANK's default, on ZT_LORA_TARGETS' default (attention)


def headline_hardware() -> Any:
    from zerotuner.machine.hardware import GPU, Hardware, OpStatus

    ok = (OpStatus("cpu_adam", True, False, True), OpStatus("async_io", True, False, True))
    return Hardware(
        accelerator="cuda",
        gpus=(GPU(0, GPU_NAME, GPU_MEMORY, GPU_MEMORY - GiB // 2, (8, 9)),),
        host_memory=HOST_MEMORY, cpu_count=ASSUMED_HOST_CORES, ops=ok, libaio=True,
    )  # fmt: skip


def unet_flops(batch: int = 1, latent: int = 128, lora_rank: int = 0) -> tuple[float, float]:
    """(forward, backward) FLOPs of the SDXL UNet for `batch` images, counted on meta; with
    `lora_rank`, of the frozen UNet with an attention adapter (as the trainer builds it)."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    from zerotuner.families import REGISTRY
    from zerotuner.weights.lora import ATTENTION, make_config

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(REGISTRY["sdxl"].builtin_config)
        if lora_rank:
            unet.requires_grad_(False)
            adapter = {"rank": lora_rank, "alpha": lora_rank, "targets": ATTENTION}
            unet.add_adapter(make_config(adapter))
        x = torch.randn(batch, 4, latent, latent)
        cond = {"text_embeds": torch.randn(batch, 1280), "time_ids": torch.randn(batch, 6)}
        with FlopCounterMode(display=False) as forward:
            out = unet(x, torch.tensor([500] * batch), torch.randn(batch, 77, 2048),
                       added_cond_kwargs=cond).sample  # fmt: skip
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    return float(forward.get_total_flops()), float(backward.get_total_flops())


def cpu_adam_elements_per_s(numel: int = 20_000_000, steps: int = 3) -> dict[str, float]:
    """DeepSpeed's CPU Adam (what optimizer offload runs) on this machine, all its threads."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = DeepSpeedCPUAdam([param], lr=1e-4, adamw_mode=True)
    opt.step()  # allocate the moments
    started = time.perf_counter()
    for _ in range(steps):
        opt.step()
    seconds = (time.perf_counter() - started) / steps
    return {"elements_per_s": numel / seconds, "threads": torch.get_num_threads()}


def lora_headline() -> dict[str, Any]:
    """The headline job as LoRA: the planner's choice and memory, and a step on paper."""
    from zerotuner.families import model_shape
    from zerotuner.preflight.plan import PlanRequest, make_plan
    from zerotuner.preflight.trainable import lora_adapter
    from zerotuner.weights.lora import PRESETS

    shape = model_shape("sdxl")
    training = lora_adapter(shape, rank=LORA_RANK, targets=PRESETS["attention"])
    plan = make_plan(
        shape=shape, hardware=headline_hardware(), training=training,
        request=PlanRequest(resolution=1024, micro_batch=8, world_size=1, mixed_precision="auto"),
    )  # fmt: skip
    choice = plan.choice
    fwd, bwd = unet_flops(lora_rank=LORA_RANK)
    recompute = fwd if choice.gradient_checkpointing else 0.0
    flops = 8 * (fwd + bwd + recompute)
    # The adapter's optimizer state stays on the GPU unless the plan offloads it: no CPU Adam
    # and no PCIe traffic per step beyond the batch.
    return {
        "rank": LORA_RANK,
        "targets": "attention",
        "trainable_params": training.trainable_params,
        "frozen_params": training.frozen_params,
        "choice": choice.choice() | {"label": choice.label()},
        "reasons": list(plan.reasons),
        "device_bytes": choice.device_bytes,
        "host_bytes": choice.host_bytes,
        "load_peak_host_bytes": plan.load.peak_bytes,
        "parts_bytes": choice.parts,
        "flops": {"forward_per_image": fwd, "backward_per_image": bwd, "step": flops},
        "step_seconds": flops / (GPU_BF16_TFLOPS * 1e12 * ASSUMED_MFU),
    }


def headline(adam: dict[str, float] | None = None) -> dict[str, Any]:
    from zerotuner.families import model_shape
    from zerotuner.preflight.plan import PlanRequest, make_plan

    shape = model_shape("sdxl")
    plan = make_plan(
        shape=shape, hardware=headline_hardware(),
        request=PlanRequest(resolution=1024, micro_batch=8, world_size=1, mixed_precision="auto"),
    )  # fmt: skip
    choice = plan.choice
    fwd, bwd = unet_flops()
    psi = shape.denoiser_params
    images = 8
    recompute = fwd if choice.gradient_checkpointing else 0.0
    compute_flops = images * (fwd + bwd + recompute)
    compute_s = compute_flops / (GPU_BF16_TFLOPS * 1e12 * ASSUMED_MFU)
    parts_s: dict[str, float] = {"gpu_forward_backward": compute_s}
    if choice.offload_optimizer == "cpu":
        adam = adam or cpu_adam_elements_per_s()
        per_core = adam["elements_per_s"] / max(1, adam["threads"])
        parts_s["cpu_adam_step"] = psi / (per_core * ASSUMED_HOST_CORES)
        # bf16 grads out during backward, updated bf16 params back after the step; the
        # grads overlap with backward in ZeRO-2 (overlap_comm), the params do not.
        parts_s["params_to_gpu"] = 2 * psi / PCIE_BYTES_PER_S
        parts_s["grads_to_host_overlapped"] = 2 * psi / PCIE_BYTES_PER_S
    total = sum(v for k, v in parts_s.items() if not k.endswith("_overlapped"))
    return {
        "ESTIMATE": "planner formulas + FLOPs on meta + assumed MFU/PCIe/CPU; not measured",
        "setup": {
            "model": "SDXL 1.0 UNet",
            "unet_params": psi,
            "resolution": 1024,
            "batch": images,
            "gpu": GPU_NAME,
            "gpu_memory_gib": GPU_MEMORY / GiB,
            "host_memory_gib": HOST_MEMORY / GiB,
        },  # fmt: skip
        "seed_measured": {
            "device_mib": 13102,
            "seconds_per_step": 8.0,
            "setup": "ZeRO-2, optimizer offload to CPU, bf16",
        },  # fmt: skip
        "choice": choice.choice() | {"label": choice.label()},
        "reasons": list(plan.reasons),
        "device_bytes": choice.device_bytes,
        "host_bytes": choice.host_bytes,
        "load_peak_host_bytes": plan.load.peak_bytes,
        "parts_bytes": choice.parts,
        "flops": {
            "forward_per_image": fwd,
            "backward_per_image": bwd,
            "step": compute_flops,
        },  # fmt: skip
        "assumptions": {
            "gpu_bf16_tflops": GPU_BF16_TFLOPS,
            "mfu": ASSUMED_MFU,
            "pcie_bytes_per_s": PCIE_BYTES_PER_S,
            "host_cores": ASSUMED_HOST_CORES,
            "cpu_adam_measured_here": adam,
        },  # fmt: skip
        "step_parts_seconds": parts_s,
        "step_seconds": total,
        "lora": lora_headline(),
    }


# SD3.5 Large and FLUX.1-dev full fine-tuning at 1024 px, batch 1 per GPU, bf16, on these hosts.
FLOW_HARDWARE = (("1 x 24 GB", 1, 24, 128), ("1 x 80 GB", 1, 80, 256), ("8 x 80 GB", 8, 80, 1024))
FLOW_MODELS = (
    ("SD3.5 Large", "sd3"), ("FLUX.1-dev", "flux"),
    ("FLUX.1-Kontext-dev", "fluxkontext"),  # the reference image's tokens beside the target's
    # the control's latent tokens beside the target's, its vision tokens in the caption
    ("Qwen-Image-Edit", "qwenimageedit"),
    # planned for its most references, 3: each a target's tokens and 201 in the caption
    ("Qwen-Image-Edit-2509 (3 references)", "qwenimageeditplus"),
)  # fmt: skip


def flow_plan(
    family: str, gpus: int, gpu_gib: int, host_gib: int, training: str = "full",
    resolution: int | None = 1024, frames: int | None = None, base_precision: str = "auto",
) -> dict[str, Any]:  # fmt: skip
    """`zerotuner plan --json` for a flow family on what-if hardware (`training`: full, or
    lora with the default adapter, as ZT_TRAINING_TYPE says; `resolution` None: the family's
    native; `frames`: a video family's ZT_VIDEO_FRAMES; `base_precision`: a LoRA base's
    storage, ZT_BASE_PRECISION). `family` may name one of CONFIG_MODELS instead: its configs
    are planned as ZT_MODEL, as a hub model's are."""
    import contextlib
    import io
    import json
    import os
    import tempfile

    from zerotuner.cli import main

    out, err = io.StringIO(), io.StringIO()
    names = ("ZT_TRAINING_TYPE", "ZT_MODEL", "ZT_VIDEO_FRAMES", "ZT_BASE_PRECISION")
    before = {name: os.environ.get(name) for name in names}
    os.environ["ZT_TRAINING_TYPE"] = training
    os.environ["ZT_BASE_PRECISION"] = base_precision
    if frames is not None:
        os.environ["ZT_VIDEO_FRAMES"] = str(frames)
    model = ["--model-family", family]
    size = ["--resolution", str(resolution)] if resolution else []
    try:
        with (
            tempfile.TemporaryDirectory() as folder,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            if family in CONFIG_MODELS:
                os.environ["ZT_MODEL"] = str(config_model(Path(folder), family))
                model = []
            code = main([
                "plan", *model, *size, "--train-batch-size",
                "1", "--gpus", str(gpus), "--gpu-memory", f"{gpu_gib}GiB", "--host-memory",
                f"{host_gib}GiB", "--offload-disk", "2TB", "--bf16", "--json",
            ])  # fmt: skip
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if code == 3:  # nothing fits (EnvironmentUnfit): the planner's line, as its only reason
        error = "zerotuner: error: "  # (a library's first import may log lines before it)
        line = next(x for x in err.getvalue().splitlines() if x.startswith(error))
        return {"choice": None, "reasons": [line.removeprefix(error)]}
    assert code == 0, out.getvalue() + err.getvalue()
    return json.loads(out.getvalue())


# Published models planned from their configs (no family's built-in one): Wan2.1-T2V-14B's
# transformer as diffusers' scripts/convert_wan_to_diffusers.py writes it ("Wan-T2V-14B": 40
# layers, 40 heads of 128, ffn 13824; the built-in `wan` is the 1.3B), UMT5-XXL
# (google/umt5-xxl's config) and AutoencoderKLWan's defaults, as a folder of configs alone.
# Wan2.2-TI2V-5B: the same script (huggingface/diffusers at 58eb52c0, "Wan2.2-TI2V-5B" and
# `vae22_diffusers_config`): 30 layers, 24 heads of 128, ffn 14336, 48 latent channels; its VAE
# 160 wide (decoder 256), z_dim 48, residual, 2x2 pixel patches, 4x in time and 16x in space
# (latents_mean/std left at their defaults: the planner reads no weights). On the meta device
# (diffusers 0.42): transformer 4,999,787,712 parameters (the card's "5B"), VAE 704,688,668.
WAN_14B = {"ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}
WAN_5B = {"ffn_dim": 14336, "num_attention_heads": 24, "num_layers": 30, "in_channels": 48,
          "out_channels": 48}  # fmt: skip
WAN_VAE = {"_class_name": "AutoencoderKLWan"}  # Wan 2.1's: AutoencoderKLWan's defaults
WAN22_VAE = {"_class_name": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256,
             "z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12,
             "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16}  # fmt: skip
UMT5_XXL = {"architectures": ["UMT5EncoderModel"], "model_type": "umt5", "d_model": 4096,
            "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
            "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}  # fmt: skip
CONFIG_MODELS = {
    "wan-14b": ("wan", WAN_14B, UMT5_XXL, WAN_VAE),
    "wan-5b": ("wan", WAN_5B, UMT5_XXL, WAN22_VAE),
}


def config_model(folder: Path, name: str) -> Path:
    """CONFIG_MODELS[name] written as a pipeline folder of configs (model_index.json, the
    transformer's, the text encoder's and the VAE's): `plan` counts them on the meta device."""
    import json

    from zerotuner.families import REGISTRY

    family, transformer, text, vae = CONFIG_MODELS[name]
    spec = REGISTRY[family]
    parts = {
        "transformer": {"_class_name": spec.transformer, **spec.builtin_config, **transformer},
        "text_encoder": text,
        "vae": vae,
    }
    index = {"_class_name": spec.pipeline, "transformer": ["diffusers", spec.transformer],
             "text_encoder": ["transformers", text["architectures"][0]],
             "vae": ["diffusers", "AutoencoderKLWan"]}  # fmt: skip
    for part, config in parts.items():
        (folder / part).mkdir(parents=True)
        (folder / part / "config.json").write_text(json.dumps(config))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def flow_plans_markdown() -> str:
    """docs/models.md's table of the planner's choices for SD3.5 Large and FLUX.1-dev."""
    rows = [
        "| model | GPUs (host RAM) | training | choice | device GiB | host GiB (load peak) | "
        "disk GiB |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, family in FLOW_MODELS:
        for label, gpus, gpu_gib, host_gib in FLOW_HARDWARE:
            plan = partial(flow_plan, family, gpus, gpu_gib, host_gib)
            rows += [
                f"| {name} | {label} ({host_gib} GiB) | {r} |"
                for r in _trainings(plan, _cells_or_why)
            ]
    return "\n".join(rows) + "\n"


def _trainings(
    plan: Callable[..., dict[str, Any]], cells: Callable[[dict[str, Any]], str]
) -> list[str]:
    """A table's training column and the `cells` after it of `plan(training, base_precision=)`
    for full fine-tuning, LoRA, and LoRA on a base stored in 8 bits (ZT_BASE_PRECISION, issue
    42): fp8 and int8 in one row where the planner says the same of both."""
    out = [f"{t} | {cells(plan(t, base_precision='auto'))}" for t in ("full", "lora")]
    low = {p: cells(plan("lora", base_precision=p)) for p in ("fp8", "int8")}
    if low["fp8"] == low["int8"]:
        return [*out, f"lora, fp8 or int8 base | {low['fp8']}"]
    return out + [f"lora, {precision} base | {c}" for precision, c in low.items()]


def _cells_or_why(plan: dict[str, Any], blanks: int = 3) -> str:
    """`_chosen_cells`, or where nothing fits the planner's line ("nothing fits: ...") and
    `blanks` empty cells."""
    if plan["choice"] is None:
        return plan["reasons"][0] + " |" * blanks
    return _chosen_cells(plan)


def _chosen_cells(plan: dict) -> str:
    """A table's cells for the plan's choice: its label, device GiB, host GiB in training (at
    the load peak) and disk GiB."""
    c = plan["choice"]  # the row it picked: its memory
    row = next(r for r in plan["rows"] if all(r[k] == v for k, v in c.items()))
    load = plan["load_peak"]["host_bytes"]
    return (
        f"{row['label']} | {row['device_bytes'] / GiB:.1f} | {row['host_bytes'] / GiB:.1f} "
        f"({load / GiB:.1f}) | {row['disk_bytes'] / GiB:.1f}"
    )


# The newer families (issues 30 and 47) on the same hosts, full fine-tuning and LoRA (the default
# adapter: rank 16 on the attention projections), with host memory per node in training and at
# the load peak (the caching phase's text encoder counted in it).
FAMILY_MODELS = (
    ("Chroma1-HD", "chroma"), ("Z-Image-Turbo", "zimage"), ("Qwen-Image", "qwenimage"),
    ("FLUX.2-dev", "flux2"), ("FLUX.2-klein-4B", "flux2klein"),
    ("Krea-2-Raw", "krea2"), ("HiDream-I1-Full", "hidream"),
    ("Wan2.1-T2V-1.3B", "wan"), ("Wan2.1-T2V-14B", "wan-14b"),
)  # fmt: skip


def family_plans_markdown() -> str:
    """docs/models.md's table of the planner's choices for the newer families (Wan: one 1024 px
    frame, an image as a one-frame clip; `video_plans_markdown` plans its clips)."""
    rows = [
        "| model | GPUs (host RAM) | training | choice | device GiB | host GiB per node: "
        "training (load peak) | disk GiB |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, family in FAMILY_MODELS:
        frames = 1 if family.startswith("wan") else None
        for label, gpus, gpu_gib, host_gib in FLOW_HARDWARE:
            plan = partial(flow_plan, family, gpus, gpu_gib, host_gib, frames=frames)
            rows += [
                f"| {name} | {label} ({host_gib} GiB) | {r} |"
                for r in _trainings(plan, _cells_or_why)
            ]
    return "\n".join(rows) + "\n"


# The video families' models on the same hosts, clips of ZT_VIDEO_FRAMES=81 at their native size
# (Wan's 480p, 832 x 480: ZT_RESOLUTION's default for wan, 632, the side of a square of that area;
# LTX-2's 768 x 512 and HunyuanVideo 1.5's 848 x 480: 640), full and LoRA, the planner choosing
# gradient checkpointing as everything else.
VIDEO_MODELS = (
    ("Wan2.1-T2V-1.3B", "wan"), ("Wan2.2-TI2V-5B", "wan-5b"), ("Wan2.1-T2V-14B", "wan-14b"),
    ("LTX-2", "ltx2"),  # 81 frames is 8k + 1 for its VAE too
    ("LTX-2 (image-to-video)", "ltx2i2v"),  # the same network and clip: its own rows
    ("Wan2.1-I2V-14B-480P", "wani2v"),  # the family's built-in config: its published one
    ("HunyuanVideo-1.5 (480p T2V)", "hunyuanvideo15"),  # 480p's 848 x 480: 640
    ("HunyuanVideo-1.5 (480p I2V)", "hunyuanvideo15i2v"),  # the same network, SigLIP beside it
)  # fmt: skip
VIDEO_FRAMES = 81


def video_plans_markdown() -> str:
    """docs/models.md's table of the planner's choices for the video families' clips."""
    rows = [
        "| model | GPUs (host RAM) | training | clip: frames (latent), tokens | choice | device "
        "GiB | host GiB per node: training (load peak) | disk GiB |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for name, family in VIDEO_MODELS:
        for label, gpus, gpu_gib, host_gib in FLOW_HARDWARE:
            plan = partial(flow_plan, family, gpus, gpu_gib, host_gib, resolution=None,
                           frames=VIDEO_FRAMES)  # fmt: skip
            rows += [
                f"| {name} | {label} ({host_gib} GiB) | {r} |"
                for r in _trainings(plan, _clip_cells)
            ]
    return "\n".join(rows) + "\n"


def _clip_cells(plan: dict[str, Any]) -> str:
    """The clip planned and `_chosen_cells`; where nothing fits the planner's line, up to its
    advice."""
    if plan["choice"] is None:
        why = plan["reasons"][0].split("; use more")[0]
        return f"{VIDEO_FRAMES} | {why} | | |"
    i = plan["inputs"]
    clip = f"{i['frames']} ({i['latent_frames']}), {i['tokens']} at {i['resolution']} px"
    return f"{clip} | {_chosen_cells(plan)}"


# Host RAM to start SDXL full fine-tuning on one 8 x 80 GB node (1024 px, batch 8 per GPU, bf16):
# the load path before zero.Init (ZeRO-1: every rank builds the fp32 UNet) and at ZeRO-3.
NODE_LOAD_ROWS = ((1, "none"), (3, "none"), (3, "cpu"), (3, "nvme"))


def node_load_markdown() -> str:
    """docs/benchmarks.md's before/after table of the load peak on an 8-GPU node."""
    from zerotuner.families import model_shape
    from zerotuner.machine.hardware import GPU, Hardware
    from zerotuner.preflight.plan import PlanRequest, make_plan

    memory = 80 * GiB
    node = Hardware(
        "cuda", tuple(GPU(i, "H100", memory, memory, (9, 0)) for i in range(8)),
        host_memory=2048 * GiB, cpu_count=64,
    )  # fmt: skip
    rows = [
        "| SDXL full fine-tuning, 8 x 80 GB | load path | host to start (load peak) GiB "
        "| per rank at load GiB | host while training GiB |",
        "|---|---|---:|---:|---:|",
    ]
    for stage, offload_param in NODE_LOAD_ROWS:
        request = PlanRequest(
            resolution=1024, micro_batch=8, world_size=8, zero_stage=stage,
            offload_param=offload_param, mixed_precision="bf16",
        )  # fmt: skip
        plan = make_plan(
            shape=model_shape("sdxl"), hardware=node, request=request,
            offload_disk_free=2 * 10**12,
        )  # fmt: skip
        load = plan.load
        rows.append(
            f"| {plan.choice.label()} | {load.path} | {load.peak_bytes / GiB:.1f} "
            f"| {load.per_rank_bytes() / GiB:.1f} | {plan.choice.host_bytes / GiB:.1f} |"
        )
    return "\n".join(rows) + "\n"
