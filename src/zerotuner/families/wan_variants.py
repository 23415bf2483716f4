"""Wan's variants, torch-free: image-to-video's transformer shape (the `wani2v` family), the
video- or otherwise-conditioned models zerotuner refuses, and
Wan 2.2 A14B's two experts (ZT_EXPERT: which transformer a run trains, on which part of the
noise schedule), read by detection, the planner and the settings checks
(`family_settings.expert_problems`) before any weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.families.registry import REGISTRY
from zerotuner.families.stored import model_json

# Wan's image- or video-conditioned variants zerotuner does not train, as their hub names say
# them (Wan2.1-FLF2V-14B-720P, Wan2.1-VACE-1.3B, Wan2.2-Animate-14B, Wan2.2-S2V-14B); I2V is the
# `wani2v` family
WAN_CONDITIONED = ("flf2v", "vace", "animate", "s2v", "v2v")
WAN_SUPPORTED = ("zerotuner trains Wan's text-to-video models (WanPipeline: Wan 2.1 T2V 1.3B "
                 "and 14B, Wan 2.2 TI2V-5B, and Wan 2.2 T2V A14B one expert per run with "
                 "ZT_EXPERT) and its image-to-video ones (WanImageToVideoPipeline: Wan 2.1 I2V "
                 "14B, Wan 2.2 I2V A14B) on captioned clips and images")  # fmt: skip
I2V_PIPELINE = "WanImageToVideoPipeline"


def takes_first_frame(config: dict[str, Any]) -> bool:
    """A WanTransformer3DModel config of an image-to-video model: the noisy latents, 4 mask
    channels and the first frame's latents in (36 = 16 + 4 + 16), the latents out; not the
    first-last-frame model's (Wan2.1-FLF2V: the same channels, and a positional embedding of
    its two frames' image states, `pos_embed_seq_len`), which samples from a last frame too."""
    inputs, outputs = config.get("in_channels"), config.get("out_channels")
    first_last = config.get("pos_embed_seq_len") is not None
    fits = isinstance(inputs, int) and isinstance(outputs, int) and inputs == 2 * outputs + 4
    return fits and not first_last


# ZT_EXPERT: the pipeline folder (and WanPipeline attribute) of each of A14B's experts. WanPipeline
# (diffusers 0.42, pipelines/wan/pipeline_wan.py) runs `transformer` at the timesteps t >=
# boundary_ratio * num_train_timesteps (the noisy ones), `transformer_2` below.
EXPERTS = {"high": "transformer", "low": "transformer_2"}
EXPERT_FAMILIES = ("wan", "wani2v")  # Wan 2.2 T2V A14B's and I2V A14B's


def expert_range(expert: str, boundary: float) -> tuple[float, float]:
    """The part of the noise schedule (sigmas, 0 clean to 1 noise) an expert denoises."""
    return (boundary, 1.0) if expert == "high" else (0.0, boundary)


def expert_sigmas(settings: Any, boundary: float | None) -> tuple[float, float]:
    """The sigmas a run of ZT_EXPERT trains: the expert's part of the schedule, or the
    ZT_TIMESTEP_RANGE inside it; one line, exit 2, for a boundary WanPipeline never uses or a
    range outside the expert's."""
    from zerotuner.settings.schema import env_name

    expert = settings.expert
    if boundary is None or math.isnan(boundary) or not 0 < boundary < 1:
        raise ConfigError(
            f"{env_name('expert')}={expert}: the model's model_index.json names a "
            f"transformer_2 but no boundary_ratio between 0 and 1 ({boundary}), so WanPipeline "
            f"never runs one of the experts; give it the boundary_ratio it was trained with"
        )
    low, high = expert_range(expert, boundary)
    if settings.timestep_range is None:
        return low, high
    want = settings.timesteps
    if not low <= want[0] < want[1] <= high:
        raise ConfigError(
            f"{env_name('timestep_range')}={settings.timestep_range}: outside the {expert}-noise "
            f"expert's part of the schedule ({EXPERTS[expert]}: {low:g}-{high:g}, the model's "
            f"boundary_ratio {boundary:g}); give a range inside it, or unset it to train all of it"
        )
    return want


def has_experts(config: dict[str, Any]) -> bool:
    """A model_index.json naming a `transformer_2` (Wan 2.2 A14B; TI2V-5B's is null)."""
    expert = config.get("transformer_2") or [None]
    return isinstance(expert, list) and bool(expert) and bool(expert[0])


def refuse_wan_variant(
    model: Any, name: str, config: dict[str, Any] | None = None, expert: str | None = None
) -> None:
    """A Wan model other than a text- or image-to-video transformer is one line, exit 2: Wan
    2.2 A14B's two experts (a `transformer_2` in model_index.json, `A14B` in a hub name) without
    ZT_EXPERT (`expert`), and the other conditioned ones (WanVACEPipeline...; `FLF2V`, `VACE`...
    in a hub name; a WanTransformer3DModel whose input has more channels than its output other
    than image-to-video's; a local I2V pipeline's transformer too: FLF2V shares the pipeline)."""
    transformer = model / "transformer" / "config.json" if isinstance(model, Path) else None
    if name == I2V_PIPELINE and transformer and transformer.is_file():
        _refuse_wan_config(model, name, model_json(transformer), expert)
    _refuse_wan_config(model, name, config or {}, expert)


def _refuse_wan_config(model: Any, name: str, config: dict[str, Any], expert: str | None) -> None:
    import re

    lowered = name.lower()
    if not name.startswith("Wan") and not any(m in lowered for m in REGISTRY["wan"].hub_markers):
        return
    words = set(re.split(r"[^a-z0-9]+", lowered))
    pipeline = name.endswith("Pipeline") and name not in (REGISTRY["wan"].pipeline, I2V_PIPELINE)
    inputs = config.get("in_channels")  # a conditioned transformer takes more than the noise
    channels = inputs is not None and inputs != config.get("out_channels", inputs)
    if pipeline or words & set(WAN_CONDITIONED) or channels and not takes_first_frame(config):
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is an image- or video-conditioned Wan model (image-to-"
            f"video, first-last-frame, VACE, animate), trained on conditioning frames, which "
            f"zerotuner does not take; {WAN_SUPPORTED}"
        )
    if ("a14b" in words or has_experts(config)) and not expert:
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is Wan 2.2 A14B, two expert transformers (transformer "
            f"for the noisy steps, transformer_2 for the clean ones, split at its "
            f"boundary_ratio): set ZT_EXPERT=high or ZT_EXPERT=low to train one of them (one "
            f"expert per run: two runs train both; the export is a WanPipeline (or "
            f"WanImageToVideoPipeline) folder with the other expert unchanged)"
        )
