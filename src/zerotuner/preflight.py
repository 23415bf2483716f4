"""Settings -> inputs -> model shape -> plan -> DeepSpeed config: everything before launch.

`config`, `plan`, `check` and `train` all go through `preflight`, so what `config` prints is
what `train` runs. It reads files and the model's config, never weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from zerotuner.deepspeed_config import Decisions, Normalized, normalize, pins
from zerotuner.errors import ConfigError
from zerotuner.families import ModelShape, detect_family, model_shape
from zerotuner.hardware import Hardware
from zerotuner.inputs import UserInputs, apply_implied_settings, read_user_inputs
from zerotuner.notes import Note
from zerotuner.settings import Settings, env_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    family: str
    local_dir: Path | None  # a folder holding the pipeline, when one is on disk
    reason: str


@dataclass(frozen=True)
class Preflight:
    settings: Settings  # with the accelerate file's launch values filled in
    inputs: UserInputs
    hardware: Hardware
    model: ModelSource
    shape: ModelShape
    resolution: int
    world_size: int
    decisions: Decisions
    plan: object | None
    normalized: Normalized
    notes: tuple[Note, ...] = field(default=())


def resolve_model(settings: Settings) -> ModelSource:
    """A local folder, a hub id already in the cache, or a hub id judged by its name."""
    local = Path(settings.model).expanduser()
    if not local.exists():
        local = _cached_snapshot(settings) or local
    if local.is_dir():
        if settings.model_family != "auto":
            return ModelSource(settings.model_family, local, f"{env_name('model_family')}")
        return ModelSource(detect_family(local), local, f"detected from {local}")
    if settings.model_family != "auto":
        return ModelSource(settings.model_family, None, env_name("model_family"))
    looks_local = settings.model.startswith(("/", ".", "~")) or settings.model.count("/") > 1
    if looks_local:
        raise ConfigError(f"{env_name('model')}={settings.model}: no such folder")
    name = settings.model.lower()
    family = "sdxl" if "xl" in name else "sd2" if "-2" in name or "v2" in name else "sd1"
    return ModelSource(family, None, f"guessed from the hub id {settings.model!r} (not cached)")


def _cached_snapshot(settings: Settings) -> Path | None:
    """The hub cache folder of a model already downloaded, found without the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub ships with diffusers
        return None
    hit = try_to_load_from_cache(
        settings.model, "model_index.json", cache_dir=str(settings.cache_dir / "huggingface/hub")
    )
    return Path(hit).parent if isinstance(hit, str) else None


def world_size_of(settings: Settings, hardware: Hardware) -> int:
    per_node = settings.num_processes or hardware.device_count
    return per_node * (settings.nnodes or 1)


def preflight(
    settings: Settings, *, hardware: Hardware, world_size: int | None = None
) -> Preflight:
    inputs = read_user_inputs(settings)
    settings = apply_implied_settings(settings, inputs)
    if hardware.accelerator in ("mps", "rocm"):
        from zerotuner.errors import EnvironmentUnfit

        raise EnvironmentUnfit(
            f"DeepSpeed training is not supported on {hardware.accelerator} in this image; "
            "run it on an NVIDIA GPU or set ZT_DEVICE=cpu"
        )
    model = resolve_model(settings)
    shape = model_shape(model.family, model.local_dir)  # type: ignore[arg-type]
    resolution = settings.resolution or shape.native_resolution
    world = world_size or world_size_of(settings, hardware)
    user_pins = pins(settings, inputs.deepspeed)
    decisions, plan = decide(settings, hardware, shape, resolution, world, user_pins)
    normalized = normalize(
        inputs.deepspeed,
        settings=settings,
        hardware=hardware,
        shape=shape,
        world_size=world,
        decisions=decisions,
        source=inputs.source,
    )
    notes = (
        Note("info", f"model family {model.family} ({model.reason}); UNet {shape.source}"),
        *inputs.notes.notes,
        *normalized.notes,
    )
    return Preflight(
        settings, inputs, hardware, model, shape, resolution, world, decisions, plan,
        normalized, notes,
    )  # fmt: skip


def decide(settings, hardware, shape, resolution, world_size, user_pins):  # noqa: ANN001, ANN201
    """The planner's choice, keeping what the user pinned."""
    from zerotuner import plan as planner

    result = planner.make_plan(
        shape,
        hardware,
        resolution=resolution,
        micro_batch=settings.train_batch_size,
        world_size=world_size,
        gradient_checkpointing=settings.gradient_checkpointing,
        zero_stage=user_pins.zero_stage if user_pins.zero_stage is not None else "auto",
        offload_optimizer=user_pins.offload_optimizer or "auto",
        offload_param=user_pins.offload_param or "auto",
        ema=settings.ema,
        offload_disk_free=None,
    )
    choice = result.choice
    decisions = Decisions(
        zero_stage=int(choice.zero_stage),
        offload_optimizer=choice.offload_optimizer,
        offload_param=choice.offload_param,
        gradient_checkpointing=bool(choice.gradient_checkpointing),
    )
    return decisions, result
