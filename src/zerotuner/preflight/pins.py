"""What the user pinned for the planner (a ZT_* setting or a key of their raw DeepSpeed config),
which ZeRO stage / offload combinations DeepSpeed can run, and how the two are reported.

A raw config's offload that its own stage cannot run is not a pin (the seed's stage-2 example
offloads parameters): the normalizer drops it, warning why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.settings.config_values import config_section, is_number
from zerotuner.settings.schema import Settings, env_name


def legal(stage: int, optimizer: str, param: str) -> str | None:
    """Why DeepSpeed cannot run this combination, or None."""
    if stage == 0 and optimizer != "none":
        return "optimizer offload needs ZeRO stage >= 1"
    if param != "none" and stage != 3:
        return "parameter offload needs ZeRO stage 3"
    if optimizer == "nvme" and stage != 3:
        return "NVMe optimizer offload needs ZeRO stage 3 (below it DeepSpeed silently uses cpu)"
    return None


@dataclass(frozen=True)
class Pins:
    """Choices the user made (by setting or in the raw config) that the planner must keep."""

    zero_stage: int | None
    offload_optimizer: str | None
    offload_param: str | None
    names: dict[str, str]  # where each pin came from: a ZT_* name or a DeepSpeed key
    # the precision asked for (no | fp16 | bf16 | auto): an explicit ZT_MIXED_PRECISION, else
    # the raw config's bf16 / fp16 sections, else the setting's default (plan.resolve_precision
    # turns it into the one DeepSpeed runs, for the planner and normalize alike)
    mixed_precision: str = "auto"


def config_precision(base: dict[str, Any]) -> str | None:
    """The precision a raw DeepSpeed config's bf16 / fp16 sections ask for: the one enabled,
    no (fp32) when it disables every one it has, None when it says nothing (or enables both:
    an error that normalize reports)."""
    bf16, fp16 = config_section(base, "bf16"), config_section(base, "fp16")
    if bf16.get("enabled") is True:
        return None if fp16.get("enabled") is True else "bf16"
    if fp16.get("enabled"):
        return "fp16"
    sections = [section for key, section in (("bf16", bf16), ("fp16", fp16)) if key in base]
    if sections and all(x.get("enabled") is False for x in sections):
        return "no"  # the user's config disables both explicitly
    return None


def pins(settings: Settings, base: dict[str, Any]) -> Pins:
    """What the planner must keep. A raw config's offload that its own stage cannot run (the
    seed's stage-2 example offloads parameters) is not a pin: normalize drops it, warning."""
    zero = base.get("zero_optimization") or {}
    zero = zero if isinstance(zero, dict) else {}
    names = {key: env_name(key) for key in ("zero_stage", "offload_optimizer", "offload_param")}
    stage: int | None = None
    if settings.zero_stage != "auto":
        stage = int(settings.zero_stage)
    elif is_number(zero.get("stage")):
        stage = int(float(zero["stage"]))
        names["zero_stage"] = "zero_optimization.stage"
    offloads: dict[str, str | None] = {}
    for key in ("offload_optimizer", "offload_param"):
        setting = getattr(settings, key)
        section = zero.get(key)
        device = section.get("device") if isinstance(section, dict) else None
        if setting != "auto":
            offloads[key] = setting
        elif key == "offload_optimizer" and device == "nvme" and stage in (1, 2):
            offloads[key] = "cpu"  # what DeepSpeed itself does below stage 3
            names[key] = f"zero_optimization.{key}.device"
        elif device in (None, "auto") or illegal_at(stage, key, str(device).lower()):
            offloads[key] = None
        else:
            offloads[key] = str(device).lower()
            names[key] = f"zero_optimization.{key}.device"
    precision: str = settings.mixed_precision
    if "mixed_precision" not in settings.model_fields_set:
        precision = config_precision(base) or precision
    return Pins(stage, offloads["offload_optimizer"], offloads["offload_param"], names, precision)


def illegal_at(stage: int | None, key: str, device: str) -> str | None:
    """Why ZeRO `stage` cannot offload `key` to `device` (None: it can, or no stage is set)."""
    if stage is None or device == "none":
        return None
    optimizer, param = (device, "none") if key == "offload_optimizer" else ("none", device)
    return legal(stage, optimizer, param)


def check_pins(
    zero_stage: Any, offload_optimizer: str, offload_param: str, names: dict[str, str]
) -> None:
    if zero_stage == "auto":
        return
    stage = int(zero_stage)
    why = legal(
        stage,
        "none" if offload_optimizer == "auto" else offload_optimizer,
        "none" if offload_param == "auto" else offload_param,
    )
    if why:
        raise ConfigError(
            f"{names['zero_stage']}={zero_stage} with {names['offload_optimizer']}="
            f"{offload_optimizer}, {names['offload_param']}={offload_param}: {why}"
        )


def pin_text(names: dict[str, str], stage: Any, opt: str, param: str, ckpt: Any) -> str:
    pins = [
        f"{names[key]}={value}"
        for key, value in (
            ("zero_stage", stage),
            ("offload_optimizer", opt),
            ("offload_param", param),
            ("gradient_checkpointing", ckpt),
        )
        if value != "auto"
    ]
    return f" with {', '.join(pins)}" if pins else ""
