"""Settings -> inputs -> model shape -> plan -> DeepSpeed config: everything before launch.

`config`, `plan`, `check` and `train` all go through `preflight`, so what `config` prints is
what `train` runs. It reads files and the model's config, never weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from zerotuner import checkpoint, lora, speed, trainable
from zerotuner.deepspeed_config import Decisions, Normalized, normalize
from zerotuner.effective import Effective
from zerotuner.errors import ConfigError
from zerotuner.families import (
    FAMILIES,
    HUB_CONFIG_FILES,
    ModelShape,
    check_family_settings,
    detect_family,
    guess_family,
    hub_cache_dir,
    model_shape,
)
from zerotuner.hardware import Hardware, require_supported
from zerotuner.inputs import UserInputs
from zerotuner.launch import Topology, resolve_topology
from zerotuner.notes import Note
from zerotuner.offload import free_bytes_at
from zerotuner.pins import pins
from zerotuner.plan import Plan, make_plan
from zerotuner.settings import Settings, env_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    family: str
    local_dir: Path | None  # a folder holding the pipeline (or a hub model's configs) on disk
    reason: str
    hub_id: str | None = None  # a hub model: the ranks download it (once per node)
    revision: str | None = None  # the hub commit whose configs were read: the ranks load it

    @property
    def job_model(self) -> str:
        """What the ranks load: a local folder, or the hub id (with `revision`)."""
        return self.hub_id or str(self.local_dir)


@dataclass(frozen=True)
class Preflight:
    settings: Settings  # with the accelerate file's launch values filled in
    inputs: UserInputs
    hardware: Hardware
    model: ModelSource
    shape: ModelShape
    resolution: int
    topology: Topology
    decisions: Decisions
    plan: Plan
    normalized: Normalized
    notes: tuple[Note, ...] = field(default=())


def resolve_model(settings: Settings, *, offline: bool = False) -> ModelSource:
    """A local folder; or a hub id, judged by its configs (from the cache, else fetched: a few
    KB, the weights are the ranks' job), or by its name when the hub cannot be reached.
    `offline`: no request to the hub (as HF_HUB_OFFLINE, which it adds to)."""
    local = Path(settings.model).expanduser()
    hub_id = revision = None
    unreachable = "not cached"
    if not local.exists() and not settings.model.startswith(("/", ".", "~")):
        snapshot = _cached_snapshot(settings)
        if snapshot is None:
            snapshot, unreachable = _fetch_configs(settings, offline=offline)
        if snapshot is not None:
            local, hub_id, revision = snapshot, settings.model, snapshot.name
    if local.is_dir():
        if settings.model_family != "auto":
            family, reason = settings.model_family, env_name("model_family")
        else:
            where = f"its configs at commit {revision[:12]}" if revision else str(local)
            family, reason = detect_family(local), f"detected from {where}"
        return ModelSource(family, local, reason, hub_id, revision)
    if settings.model_family != "auto":
        return ModelSource(settings.model_family, None, env_name("model_family"), settings.model)
    looks_local = settings.model.startswith(("/", ".", "~")) or settings.model.count("/") > 1
    if looks_local:
        raise ConfigError(f"{env_name('model')}={settings.model}: no such folder")
    family = guess_family(settings.model)
    if family is None:
        raise ConfigError(
            f"{env_name('model')}={settings.model}: its configs cannot be read ({unreachable}) "
            f"and the name does not say the model family; set {env_name('model_family')} to one "
            f"of {', '.join(FAMILIES)}"
        )
    reason = f"guessed from the hub id {settings.model!r} ({unreachable})"
    return ModelSource(family, None, reason, settings.model)


def _cached_snapshot(settings: Settings) -> Path | None:
    """The hub cache folder of a model already downloaded, found without the network."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        hit = try_to_load_from_cache(
            settings.model, "model_index.json", cache_dir=str(hub_cache_dir(settings.cache_dir))
        )
    except HFValidationError:  # not a hub id at all: the caller reports the missing folder
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def _fetch_configs(settings: Settings, *, offline: bool) -> tuple[Path | None, str]:
    """The hub model's config files into the HF cache: (snapshot folder, "") or (None, why not).

    A repository this token cannot read is the user's to fix (ConfigError); a hub that cannot
    be reached leaves the family to the id's name and the download to the ranks."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    if offline or constants.HF_HUB_OFFLINE:
        return None, "not cached; HF_HUB_OFFLINE is set"
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    try:
        path = snapshot_download(
            settings.model, cache_dir=str(hub_cache_dir(settings.cache_dir)), token=token,
            allow_patterns=list(HUB_CONFIG_FILES), etag_timeout=10,
        )  # fmt: skip
    except HFValidationError:
        return None, "not a hub id"
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ConfigError(
            f"{env_name('model')}={settings.model}: no such local folder, and not a hub "
            f"repository this token can read ({type(error).__name__}); check the id and "
            f"{env_name('hf_token')}"
        ) from None
    except Exception as error:  # noqa: BLE001 - no network: the ranks try again and say why
        return None, f"not cached; the hub could not be reached: {type(error).__name__}"
    return Path(path), ""


def preflight(
    effective: Effective,
    *,
    hardware: Hardware,
    topology: Topology | None = None,
    require_fit: bool = True,
    offload_disk_free: int | None | str = "measure",
) -> Preflight:
    """From the effective settings (`effective.effective_settings`: the one settings path) to
    the plan and the DeepSpeed config. `require_fit=False` (the `config` command): when nothing
    fits this machine, plan the closest option anyway and say so, so a config can be checked
    before renting GPUs. `offload_disk_free`: bytes free for NVMe offload (None: unknown); by
    default measured at ZT_OFFLOAD_DIR."""
    settings, inputs = effective.settings, effective.inputs
    lora.check_settings(settings)
    require_supported(hardware)
    model = resolve_model(settings, offline=effective.hub_offline)
    check_family_settings(settings, model.family)
    shape = model_shape(model.family, model.local_dir)  # type: ignore[arg-type]
    check_resume(settings, model.family, shape)
    if settings.training_type == "lora":
        lora.check_model_targets(settings, model.family, model.local_dir)
    resolution = settings.resolution or shape.native_resolution
    topology = topology or resolve_topology(settings, hardware, os.environ)
    world = topology.world_size
    plan = plan_for(
        settings,
        shape,
        hardware,
        base=inputs.deepspeed,
        world_size=world,
        ranks_per_node=topology.nproc_per_node,
        offload_disk_free=(
            free_bytes_at(settings.offload_dir)
            if offload_disk_free == "measure"
            else offload_disk_free
        ),
        require_fit=require_fit,
        model_dir=model.local_dir,
    )
    decisions = decisions_from(plan)
    lora.check_init_stage(settings, decisions.zero_stage)
    normalized = normalize(
        inputs.deepspeed,
        settings=settings,
        hardware=hardware,
        shape=shape,
        world_size=world,
        decisions=decisions,
        source=inputs.source,
    )
    unfit = () if require_fit or plan.choice.fits else (Note("warning", plan.reasons[0]),)
    notes = (
        *unfit,
        Note("info", f"model family {model.family} ({model.reason}); model {shape.source}"),
        *lora.notes(settings),
        *speed.notes(settings, accelerator=hardware.accelerator, zero_stage=decisions.zero_stage),
        *inputs.notes.notes,
        *normalized.notes,
    )
    return Preflight(
        settings, inputs, hardware, model, shape, resolution, topology, decisions, plan,
        normalized, notes,
    )  # fmt: skip


def check_resume(settings: Settings, family: str, shape: ModelShape) -> None:
    """The checkpoint a resume would load must be of this model family, size and training
    type (and a LoRA's adapter shape): refused here, before any rank loads a weight."""
    path = checkpoint.resume_candidate(settings.resume, settings.output_dir)
    if path is None:
        return
    manifest = checkpoint.read_manifest(path) or {}
    checkpoint.check_model(
        manifest, family=family, denoiser_params=shape.unet_params, model=settings.model,
        path=path,
    )  # fmt: skip
    lora.check_resume(manifest, settings, path)


def plan_for(
    settings: Settings,
    shape: ModelShape,
    hardware: Hardware,
    *,
    base: dict,
    world_size: int,
    ranks_per_node: int,
    offload_disk_free: int | None,
    require_fit: bool = True,
    model_dir: Path | None = None,
) -> Plan:
    """The planner's choice for these settings, keeping what the user pinned (env or raw JSON).
    `model_dir`: the model's folder, whose UNet config sizes a LoRA adapter (else the family's
    built-in config)."""
    user = pins(settings, base)
    return make_plan(
        shape,
        hardware,
        resolution=settings.resolution or shape.native_resolution,
        micro_batch=settings.train_batch_size,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        gradient_checkpointing=settings.gradient_checkpointing,
        zero_stage="auto" if user.zero_stage is None else user.zero_stage,
        offload_optimizer=user.offload_optimizer or "auto",
        offload_param=user.offload_param or "auto",
        ema=settings.ema,
        offload_disk_free=offload_disk_free,
        mixed_precision=user.mixed_precision,
        require_fit=require_fit,
        pin_names=user.names,
        training=trainable.for_settings(settings, shape, model_dir),
        max_sequence_length=settings.max_sequence_length,
    )


def decisions_from(plan: Plan) -> Decisions:
    choice = plan.choice
    return Decisions(
        zero_stage=int(choice.zero_stage),
        offload_optimizer=choice.offload_optimizer,
        offload_param=choice.offload_param,
        gradient_checkpointing=bool(choice.gradient_checkpointing),
    )
