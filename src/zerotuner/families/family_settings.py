"""Settings that do not apply to a family: the other objective's (a UNet's DDPM, a
transformer's flow matching), video settings on an image family, a clip length the VAE cannot
take, text-encoder adapters on a transformer, and ZT_EXPERT against the model.
"""

from __future__ import annotations

from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.families.registry import REGISTRY
from zerotuner.families.shapes import ModelShape, video_scales
from zerotuner.families.wan_variants import EXPERT_FAMILIES, expert_sigmas

UNET_SETTINGS = ("prediction_type", "snr_gamma", "noise_offset")  # DDPM's
FLOW_SETTINGS = (
    "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "train_guidance",
    "max_sequence_length",
)  # fmt: skip


VIDEO_SETTINGS = ("video_frames", "video_fps", "video_windows")


def check_family_settings(settings: Any, family: str, shape: ModelShape | None = None) -> None:
    """A setting of the other objective (a UNet's DDPM, a transformer's flow matching), or
    one the family cannot do yet, is one line, exit 2: a video setting for an image family, or
    a clip length a video family's VAE cannot take (`shape`: the model's own, whose VAE says
    the frame rule; else the family's published one)."""
    from zerotuner.settings.schema import env_name

    problems = []
    if not REGISTRY[family].video:
        videos = ", ".join(f for f, spec in REGISTRY.items() if spec.video)
        problems += [
            f"{env_name(name)} is set but ZT_MODEL is a {family} model, trained on images: unset "
            f"{env_name(name)} (it applies to the video families only: {videos})"
            for name in VIDEO_SETTINGS
            if name in settings.model_fields_set
        ]
        if settings.offload_activations == "cpu":
            problems.append(
                f"{env_name('offload_activations')}=cpu: {family}'s activations are not counted "
                f"per block, so the planner cannot place them (the video families': {videos}); "
                f"set it to auto or none"
            )
    else:
        video = shape.video if shape is not None else None
        step = video.temporal if video is not None else video_scales(None)[0]
        frames = settings.video_frames
        if (frames - 1) % step:
            below = (frames - 1) // step * step + 1
            problems.append(
                f"{env_name('video_frames')}={frames}: {REGISTRY[family].cls} takes "
                f"{step}k+1 frames ({below} or {below + step})"
            )
    flow = REGISTRY[family].flow
    kind = "flow matching (a transformer family)" if flow else "a DDPM UNet (SD 1.x/2.x/XL)"
    foreign = FLOW_SETTINGS if not flow else UNET_SETTINGS
    problems += [
        f"{env_name(name)} is set but ZT_MODEL is a {family} model, trained by {kind}: unset "
        f"{env_name(name)} (it applies to "
        f"{'the transformer families' if name in FLOW_SETTINGS else 'the UNet families'} only)"
        for name in foreign
        if name in settings.model_fields_set
    ]
    if settings.offload_activations == "cpu" and settings.gradient_checkpointing is False:
        problems.append(
            f"{env_name('offload_activations')}=cpu with {env_name('gradient_checkpointing')}="
            "false: only checkpointed activations (each block's input) go to host memory; set "
            f"{env_name('gradient_checkpointing')}=true or auto, or "
            f"{env_name('offload_activations')}=none"
        )
    problems += expert_problems(settings, family, shape)
    if flow and settings.training_type == "lora" and settings.lora_text_encoder:
        problems.append(
            f"{env_name('lora_text_encoder')}=true: text encoder adapters are for the UNet "
            f"families so far; unset it to train the {family} transformer's adapter alone"
        )
    if REGISTRY[family].captions_per_item and settings.caption_dropout > 0:
        problems.append(
            f"{env_name('caption_dropout')}={settings.caption_dropout:g}: {family}'s captions "
            "are encoded with their control image and cached per image, so none can be "
            f"swapped for the empty caption yet; unset {env_name('caption_dropout')}"
        )
    if problems:
        raise ConfigError(problems[0], problems=problems)


def expert_problems(settings: Any, family: str, shape: ModelShape | None) -> list[str]:
    """ZT_EXPERT against the model: set for a model with one denoiser (a non-Wan family, or a
    Wan model whose configs were read and have no transformer_2), or unset for Wan 2.2 A14B
    (ZT_MODEL_FAMILY=wan skips detection's refusal), or its sigmas (`expert_sigmas`)."""
    from zerotuner.settings.schema import env_name

    expert, name = settings.expert, env_name("expert")
    read = shape is not None and not shape.source.startswith("built-in")
    boundary = shape.boundary_ratio if shape is not None else None
    if expert and family not in EXPERT_FAMILIES:
        why = f"it chooses one of Wan 2.2 A14B's two expert transformers; unset {name}"
        return [f"{name}={expert} is set but ZT_MODEL is a {family} model: {why}"]
    if expert and read and boundary is None:
        why = f"not Wan 2.2 A14B's two experts (no transformer_2 in model_index.json); unset {name}"
        return [f"{name}={expert} is set but ZT_MODEL has one transformer, {why}"]
    if not expert and boundary is not None:
        why = f"set {name}=high or {name}=low to train one of them (one expert per run)"
        return [f"ZT_MODEL={settings.model} is Wan 2.2 A14B, two expert transformers: {why}"]
    if expert and read:
        try:
            expert_sigmas(settings, boundary)
        except ConfigError as error:
            return [str(error)]
    return []
