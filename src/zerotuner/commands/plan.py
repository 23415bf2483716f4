"""`zerotuner plan`: memory per ZeRO stage x offload for this machine (or one described by flags).

Without hardware flags it probes this machine, as `train` does; with
`--gpus/--gpu-memory/--host-memory` it plans for hardware you are about to rent. Either way it
takes the preflight steps `train` takes (preflight.what_if), so its plan is the one `train` runs.
"""

from __future__ import annotations

import argparse
import json

from zerotuner.commands import what_if
from zerotuner.families import FAMILIES, FLOW_FAMILIES, REGISTRY
from zerotuner.machine.hardware import Hardware, describe_hardware
from zerotuner.preflight.plan import Estimate, Plan, PlanInputs, gib
from zerotuner.preflight.what_if import answer_what_if, plan_json
from zerotuner.settings.schema import env_name, precision_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("what-if job (overrides the settings)")
    job.add_argument("--model-family", choices=FAMILIES, help="built-in model")
    job.add_argument("--resolution", type=int, help="pixels per side (ZT_RESOLUTION)")
    job.add_argument("--train-batch-size", type=int, help="micro batch per device")
    what_if.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def training_text(inputs: PlanInputs) -> str:
    """`full, 2567.5M trainable` or `lora, 23.2M trainable (adapter), 2567.5M frozen`."""
    trainable, frozen = inputs.trainable_params / 1e6, inputs.frozen_params / 1e6
    if inputs.training_type == "full":
        return f"full, {trainable:.1f}M trainable"
    if inputs.text_encoders_train:
        return (
            f"lora, {trainable:.1f}M trainable (UNet and text encoder adapters), {frozen:.1f}M "
            "frozen (base UNet and text encoders); captions encoded at every step, not cached"
        )
    stored = "" if inputs.base_precision == "auto" else f", stored at {inputs.base_precision}"
    return f"lora, {trainable:.1f}M trainable (adapter), {frozen:.1f}M frozen (base UNet{stored})"


def optimizer_text(inputs: PlanInputs) -> str:
    """`optimizer: prodigy, 16 bytes of state per trained parameter (AdamW: 8) ...`."""
    return (
        f"optimizer: {inputs.optimizer}, {inputs.optimizer_state_bytes:g} bytes of state per "
        "trained parameter (AdamW: 8), beside the fp32 master (4) and the gradient"
    )


def clip_text(inputs: PlanInputs) -> str:
    """A video family's clip as planned: ` x 81 frames (21 latent frames, 32760 tokens)`."""
    if inputs.frames is None:
        return ""
    return (f" x {inputs.frames} frames (ZT_VIDEO_FRAMES; {inputs.latent_frames} latent "
            f"frames, {inputs.tokens} tokens per clip)")  # fmt: skip


def render(plan: Plan, hardware: Hardware) -> str:
    i = plan.inputs
    lines = [
        f"hardware: {describe_hardware(hardware)}",
        f"job: {i.family} {'transformer' if i.family in FLOW_FAMILIES else 'UNet'} "
        f"{i.denoiser_params / 1e9:.3f}B params, {i.resolution} px{clip_text(i)}, "
        f"micro batch {i.micro_batch}, world size {i.world_size}, "
        f"{precision_name(i.precision)}",
        f"training: {training_text(i)}",
        optimizer_text(i),
        "",
        f"{'stage':>5}  {'optimizer':<9}  {'params':<6}  {'ckpt':<4}  "
        f"{'device GiB':>10}  {'host GiB':>8}  {'disk GiB':>8}  fits",
    ]
    lines += [row_line(r, "<- choice" if r == plan.choice else "") for r in plan.rows]
    lines += low_base_lines(plan)
    lines += ["", *phase_lines(plan)]
    per_caption = i.caption_cache_bytes
    # read with each image's control (Qwen-Image-Edit): one per image, as `check` counts them
    unit = "image" if REGISTRY[i.family].captions_per_item else "caption"
    lines.append(
        f"text cache (ZT_CACHE_DIR): {per_caption / 2**20:.2f} MiB per {unit}, "
        f"{per_caption * 10_000 / 2**30:.1f} GiB per 10,000 {unit}s"
        + (" (twice with ZT_RANDOM_FLIP: a mirror image is read on its own)"
           if unit == "image" else "")
        + (f" ({REGISTRY[i.family].long_encoder} states in bf16; ZT_MAX_SEQUENCE_LENGTH "
           "shortens them)" if i.family in FLOW_FAMILIES else "")
    )  # fmt: skip
    lines += ["", f"choice: {plan.choice.label()}"]
    lines += [f"  - {reason}" for reason in plan.reasons]
    lines += [f"warning: {w}" for w in hardware.warnings]
    return "\n".join(lines)


def row_line(r: Estimate, mark: str) -> str:
    return (
        f"{r.zero_stage:>5}  {r.offload_optimizer:<9}  {r.offload_param:<6}  "
        f"{_checkpointing(r):<4}  {gib(r.device_bytes):>10}  "
        f"{gib(r.host_bytes):>8}  {gib(r.disk_bytes):>8}  {'yes' if r.fits else 'no ':<4}{mark}"
    )


def _checkpointing(r: Estimate) -> str:
    """The table's ckpt column: off, on, or `cpu` (checkpointed, activations in host memory)."""
    if not r.gradient_checkpointing:
        return "off"
    return "on" if r.offload_activations == "none" else r.offload_activations


def low_base_lines(plan: Plan) -> list[str]:
    """The rows a LoRA base stored in 8 bits would make fit (`Plan.low_base`), by setting."""
    lines = []
    for low in plan.low_base:
        lines += [
            "",
            f"with {low.setting} (the base's {low.base.layers} Linear layers in 8 bits, "
            f"{gib(low.base.before)} -> {gib(low.base.after)} GiB; not chosen: "
            f"{env_name('base_precision')}=auto keeps the run's precision), these fit:",
        ]
        lines += [row_line(r, "<- its choice" if r == low.choice else "") for r in low.rows]
    return lines


def phase_lines(plan: Plan) -> list[str]:
    """Host memory per node by phase: the load peak (before the DeepSpeed engine is ready) as
    its own row, next to the training figure of the choice, with what is live in each."""
    load, usable = plan.load, plan.inputs.host_usable_bytes
    verdict = "fits" if plan.load_fits else "DOES NOT FIT"
    lines = [
        f"host per node by phase ({load.ranks_per_node} rank(s) per node; "
        f"{gib(usable)} GiB usable):"
    ]
    for phase, row in plan.phases().items():
        if phase == "caching":
            live = "+ " + ", ".join(row["live"][-1:])
        elif phase == "load":
            live = ", ".join(row["live"])
        else:
            live = row["live"][0]
        lines.append(f"  {phase:<8}  {gib(row['host_bytes']):>6} GiB  {live}")
    lines.append(f"load peak: {gib(load.peak_bytes)} of {gib(usable)} GiB usable host, {verdict}")
    return lines


def epoch_text(*, video: bool) -> str:
    """How many samples an epoch holds, as the data's file names tell (`check` decodes them):
    each dataset's pictures times its repeats (ZT_DATASETS_FILE)."""
    from zerotuner.data.scan import listed_samples
    from zerotuner.settings.datasets import sources
    from zerotuner.settings.schema import load_settings

    settings = load_settings()
    count = listed_samples(sources(settings), settings.cache_dir, video=video)
    if count is None:
        return "epoch: not counted (a dataset is not there or not fetched yet; `check` says)"
    return f"epoch: {count} samples (the files found, each once per repeat; `check` decodes them)"


def run(args: argparse.Namespace) -> int:
    plan, hardware = answer_what_if(
        what_if.from_args(args), model_family=args.model_family,
        resolution=args.resolution, train_batch_size=args.train_batch_size,
    ).plan()  # fmt: skip
    if args.json:
        print(json.dumps(plan_json(plan, hardware), indent=2))
    else:
        print(render(plan, hardware))
        print(epoch_text(video=plan.inputs.frames is not None))
    return 0
