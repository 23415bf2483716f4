"""Settings -> inputs -> model shape -> plan -> DeepSpeed config: everything before launch.

`config`, `plan`, `check` and `train` all take `PreflightRun`'s steps (`config` and `plan`
through preflight.what_if, on a machine described or probed), so what `config` prints is what
`train` runs. It reads files and the model's config, never weights.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from zerotuner.errors import ConfigError
from zerotuner.families import (
    EXPERTS,
    FAMILIES,
    HUB_CONFIG_FILES,
    REGISTRY,
    ModelShape,
    check_family_settings,
    detect_family,
    distilled_note,
    guess_family,
    hub_cache_dir,
    known_family,
    model_shape,
    refuse_missing_parts,
    unet_config_path,
)
from zerotuner.launch.ranks import Topology, resolve_topology
from zerotuner.machine.hardware import Hardware, describe_hardware, require_supported
from zerotuner.machine.offload_volume import free_bytes_at
from zerotuner.preflight import trainable
from zerotuner.preflight.deepspeed_config import Decisions, Normalized, normalize
from zerotuner.preflight.fetch import fetch_adapter
from zerotuner.preflight.optimizers import planned_optimizer
from zerotuner.preflight.pins import pins
from zerotuner.preflight.plan import Plan, PlanRequest, gib, make_plan
from zerotuner.settings.datasets import sources
from zerotuner.settings.effective import Effective
from zerotuner.settings.folders import unreadable_file
from zerotuner.settings.inputs import UserInputs
from zerotuner.settings.notes import Note
from zerotuner.settings.schema import Settings, env_name, precision_name
from zerotuner.train import speed, validation_inputs
from zerotuner.weights import base_precision, checkpoint, lora, lora_from

if TYPE_CHECKING:  # apprise loads when a URL is set
    from zerotuner.publish.notify import Target

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name


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
    resolution: int  # the job's (job_resolution); the plan sizes the largest dataset's
    topology: Topology
    decisions: Decisions
    plan: Plan
    normalized: Normalized
    notes: tuple[Note, ...] = field(default=())


def model_looks_local(model: str) -> bool:
    """Whether ZT_MODEL reads as a path (absolute, relative, under ~, deeper than owner/name)
    rather than a hub id; a folder that exists is local whatever its name."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def resolve_model(
    settings: Settings, *, offline: bool = False, will_train: bool = False
) -> ModelSource:
    """A local folder; or a hub id, judged by its configs (from the cache, else fetched: a few
    KB, the weights are the ranks' job), or by its name when the hub cannot be reached.
    `offline`: no request to the hub (as HF_HUB_OFFLINE, which it adds to). `will_train`:
    `train` (and `check`) refuse a hub model that is not cached while offline, since the ranks
    could not download it; `config` and `plan` judge it by its name."""
    known_family(settings.model_family, auto=True)
    name = f"{env_name('model')}={settings.model}"
    local = Path(settings.model).expanduser()
    looks_local = model_looks_local(settings.model)
    if not local.exists() and not looks_local and not HUB_ID.match(settings.model):
        raise ConfigError(
            f"{name}: neither a local folder nor a hub id like "
            "'stabilityai/stable-diffusion-xl-base-1.0'"
        )
    hub_id = revision = None
    unreachable = "not cached"
    if not local.exists() and not looks_local:
        snapshot = _cached_snapshot(settings)
        if snapshot is None and will_train and (offline or _hub_offline()):
            raise ConfigError(
                f"{name}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it "
                "first (or unset HF_HUB_OFFLINE), or give a local pipeline folder"
            )
        if snapshot is None:
            snapshot, unreachable = _fetch_configs(settings, offline=offline)
        if snapshot is not None:
            local, hub_id, revision = snapshot, settings.model, snapshot.name
    if local.is_dir():
        if (unreadable := unreadable_file(local)) is not None:
            raise ConfigError(
                f"{name}: {unreadable} cannot be read by uid {os.getuid()}; make the model's "
                "files readable (chmod -R a+rX) or run as their owner"
            )
        if settings.model_family != "auto":
            if unet_config_path(local) is None:
                raise ConfigError(
                    f"{name}: no unet/config.json (or config.json) in that folder; point it at "
                    "a diffusers pipeline folder"
                )
            family, reason = settings.model_family, env_name("model_family")
        else:
            where = f"its configs at commit {revision[:12]}" if revision else str(local)
            family, reason = detect_family(local, settings.expert), f"detected from {where}"
        refuse_missing_parts(family, local, name)
        return ModelSource(family, local, reason, hub_id, revision)
    if looks_local:
        raise ConfigError(f"{name}: no such folder")
    if settings.model_family != "auto":
        return ModelSource(settings.model_family, None, env_name("model_family"), settings.model)
    guessed = guess_family(settings.model, settings.expert)
    if guessed is None:
        raise ConfigError(
            f"{env_name('model')}={settings.model}: its configs cannot be read ({unreachable}) "
            f"and the name does not say the model family; set {env_name('model_family')} to one "
            f"of {', '.join(FAMILIES)}"
        )
    reason = f"guessed from the hub id {settings.model!r} ({unreachable})"
    return ModelSource(guessed, None, reason, settings.model)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


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
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    if offline or _hub_offline():
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


def listed_controls(settings: Settings) -> int | None:
    """The most control images a target of the run's data has, as their file names tell
    (data.scan.listed_references); None where that is not known here (a dataset not there or
    not fetched, a datasets file the dataset step refuses)."""
    from zerotuner.data.scan import listed_references

    try:
        return listed_references(sources(settings), settings.cache_dir)
    except ConfigError:  # said by the step that reads the data, in its place
        return None


class PreflightRun:
    """Preflight's steps in order, on one state. `preflight()` runs them all; `check` reports
    them one by one (`STEPS`), so what `check` accepts `train` starts, and what it refuses
    `train` refuses with the same line. Each step returns what it found, in words, and the
    warnings it has (what `check` prints).

    `hardware`: the machine (described or already probed); None probes this one in the first
    step. `require_fit=False` (a what-if: `config`, `plan`, the builder): when nothing fits
    this machine, plan the closest option anyway and say so (`Plan.unfit`), so a config can be
    checked before renting GPUs.
    `offload_disk_free`: bytes free for NVMe offload (None: unknown); by default measured at
    ZT_OFFLOAD_DIR. `model`: the model when the caller names it (`plan --model-family`: the
    family's built-in config), instead of resolving ZT_MODEL."""

    def __init__(
        self,
        effective: Effective,
        *,
        hardware: Hardware | None = None,
        topology: Topology | None = None,
        require_fit: bool = True,
        offload_disk_free: int | Literal["measure"] | None = "measure",
        model: ModelSource | None = None,
    ) -> None:
        self.effective = effective
        self.settings, self.inputs = effective.settings, effective.inputs
        self.hardware, self.topology = hardware, topology
        self.require_fit = require_fit
        self.offload_disk_free = offload_disk_free
        self.model = model
        self.shape: ModelShape | None = None
        self.plan: Plan | None = None
        self.decisions: Decisions | None = None
        self.normalized: Normalized | None = None
        self.model_warnings: list[str] = []  # the model's own (Krea 2 Turbo: train on Raw)

    def check_hardware(self) -> tuple[str, list[str]]:
        if self.hardware is None:
            from zerotuner.machine.probe import probe

            self.hardware = probe(self.settings.device)
        require_supported(self.hardware)
        return describe_hardware(self.hardware), list(self.hardware.warnings)

    def place(self) -> tuple[str, list[str]]:
        assert self.hardware is not None
        t = self.topology or resolve_topology(self.settings, self.hardware, os.environ)
        self.topology = t
        return (
            f"{t.nnodes} node(s) x {t.nproc_per_node} rank(s), this is node {t.node_rank}, "
            f"master {t.master_addr}:{t.master_port} ({t.source})"
        ), []

    def read_model(self) -> tuple[str, list[str]]:
        settings = self.settings
        lora.check_settings(settings)
        model = self.model or resolve_model(
            settings, offline=self.effective.hub_offline, will_train=self.require_fit
        )
        check_family_settings(settings, model.family)
        expert = EXPERTS.get(settings.expert or "")  # A14B: the expert this run trains
        spec = REGISTRY[model.family]
        listed = listed_controls(settings) if spec.optional_controls else None
        shape = model_shape(model.family, model.local_dir, denoiser=expert,
                            controls=spec.planned_controls(listed))  # fmt: skip
        check_family_settings(settings, model.family, shape)  # the model's VAE: its frame rule
        validation_inputs.check(settings, spec.run_sample_input(listed), spec.sample_images)
        # an adapter file's rank, alpha and targets are the run's: the plan and resume see them
        fetch_adapter(settings, offline=self.effective.hub_offline)  # an s3:// or hf:// file
        settings, _ = lora_from.apply(settings, model.family, model_dir=model.local_dir)
        self.settings = settings
        check_resume(settings, model.family, shape)
        if settings.training_type == "lora":
            lora.check_model_targets(settings, model.family, model.local_dir)
        self.model, self.shape = model, shape
        if model.local_dir is None:  # neither cached nor its configs fetched
            where = f"hub id {model.hub_id}"
            warnings = ["its configs could not be read here; train downloads it and fails "
                        "there if it cannot"]  # fmt: skip
        else:
            where = f"hub id {model.hub_id}" if model.hub_id else f"local folder {model.local_dir}"
            warnings = []
        distilled = distilled_note(model.family, model.local_dir, settings.model)
        self.model_warnings = [distilled] if distilled else []
        warnings += self.model_warnings
        params = f"{shape.denoiser_params / 1e6:.1f}M params"
        if spec.optional_controls and listed:  # a FLUX.2 run with reference images
            params += f"; planned with {spec.planned_controls(listed)} reference image(s) a target"
        return f"{where}; {model.family} ({model.reason}); denoiser {params}", warnings

    def make_plan(self) -> tuple[str, list[str]]:
        assert self.hardware and self.topology and self.model and self.shape
        settings = self.settings
        free = self.offload_disk_free
        self.plan = plan = plan_for(
            settings,
            self.shape,
            self.hardware,
            base=self.inputs.deepspeed,
            world_size=self.topology.world_size,
            ranks_per_node=self.topology.nproc_per_node,
            offload_disk_free=free_bytes_at(settings.offload_dir) if free == "measure" else free,
            require_fit=self.require_fit,
            model_dir=self.model.local_dir,
        )
        self.decisions = decisions_from(plan)
        lora.check_init_stage(settings, self.decisions.zero_stage)
        ch = plan.choice
        return (
            f"{ch.label()}: device {gib(ch.device_bytes)} GiB, host {gib(ch.host_bytes)} GiB"
            + (f", disk {gib(ch.disk_bytes)} GiB" if ch.disk_bytes else "")
            + f"; load peak {gib(plan.load.peak_bytes)} GiB host"
        ), []

    def normalize(self) -> tuple[str, list[str]]:
        assert self.hardware and self.topology and self.shape and self.decisions
        self.normalized = result = normalize(
            self.inputs.deepspeed,
            settings=self.settings,
            hardware=self.hardware,
            shape=self.shape,
            world_size=self.topology.world_size,
            decisions=self.decisions,
            source=self.inputs.source,
        )
        warnings = [str(n) for n in result.notes if n.level in ("warning", "change")]
        batch = result.config.get("train_batch_size")
        precision = precision_name(result.mixed_precision)
        return f"valid (train_batch_size {batch}, {precision})", warnings

    def check_reporting(self) -> tuple[str, list[str]]:
        return check_reporting(self.settings)[0], []

    STEPS: tuple[tuple[str, Callable[[PreflightRun], tuple[str, list[str]]]], ...] = (
        ("hardware", check_hardware),
        ("topology", place),
        ("model", read_model),
        ("plan", make_plan),
        ("deepspeed config", normalize),
        ("notifications", check_reporting),
    )

    def run(self) -> Preflight:
        for _, step in self.STEPS:
            step(self)
        return self.result()

    def result(self) -> Preflight:
        assert self.hardware and self.topology and self.model and self.shape
        assert self.plan and self.decisions and self.normalized
        settings, hardware, model, shape, plan = (
            self.settings, self.hardware, self.model, self.shape, self.plan
        )  # fmt: skip
        unfit = () if self.require_fit or plan.choice.fits else (Note("warning", plan.reasons[0]),)
        zero_stage = self.decisions.zero_stage
        notes = (
            *unfit,
            Note("info", f"model family {model.family} ({model.reason}); model {shape.source}"),
            *(Note("warning", w) for w in self.model_warnings),
            *lora.notes(settings),
            *speed.notes(settings, accelerator=hardware.accelerator, zero_stage=zero_stage),
            *self.inputs.notes.notes,
            *self.normalized.notes,
        )
        resolution = job_resolution(settings, shape)
        return Preflight(
            settings, self.inputs, hardware, model, shape, resolution, self.topology,
            self.decisions, plan, self.normalized, notes,
        )  # fmt: skip


def preflight(
    effective: Effective,
    *,
    hardware: Hardware,
    topology: Topology | None = None,
    require_fit: bool = True,
    offload_disk_free: int | Literal["measure"] | None = "measure",
) -> Preflight:
    """From the effective settings (`effective.effective_settings`: the one settings path) to
    the plan and the DeepSpeed config: every step of `PreflightRun`."""
    return PreflightRun(
        effective, hardware=hardware, topology=topology, require_fit=require_fit,
        offload_disk_free=offload_disk_free,
    ).run()  # fmt: skip


def check_resume(settings: Settings, family: str, shape: ModelShape) -> None:
    """The checkpoint a resume would load must be of this model family, size and training
    type (and a LoRA's adapter shape): refused here, before any rank loads a weight."""
    path = checkpoint.resume_candidate(settings.resume, settings.output_dir)
    if path is None:
        return
    manifest = checkpoint.read_manifest(path) or {}
    checkpoint.check_model(
        manifest, family=family, denoiser_params=shape.denoiser_params, model=settings.model,
        path=path, expert=settings.expert,
    )  # fmt: skip
    lora.check_resume(manifest, settings, path)


def job_resolution(settings: Settings, shape: ModelShape) -> int:
    """The side a dataset without a `resolution` of its own trains at: ZT_RESOLUTION, else
    the family's native one."""
    return settings.resolution or shape.native_resolution


def plan_resolution(settings: Settings, shape: ModelShape) -> int:
    """The side the plan sizes memory for: the largest any dataset trains at, since a
    datasets-file entry's own `resolution` may exceed the job's."""
    own = [source.resolution for source in sources(settings) if source.resolution]
    return max([job_resolution(settings, shape), *own])


def plan_for(
    settings: Settings,
    shape: ModelShape,
    hardware: Hardware,
    *,
    base: dict[str, Any],
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
    resolution = plan_resolution(settings, shape)
    request = PlanRequest(
        resolution=resolution,
        micro_batch=settings.train_batch_size,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        gradient_checkpointing=settings.gradient_checkpointing,
        zero_stage="auto" if user.zero_stage is None else user.zero_stage,
        offload_optimizer=user.offload_optimizer or "auto",
        offload_param=user.offload_param or "auto",
        offload_activations=settings.offload_activations,
        mixed_precision=user.mixed_precision,
        ema=settings.ema,
        max_sequence_length=settings.max_sequence_length,
        frames=settings.video_frames if shape.video is not None else 1,
        base_precision=settings.base_precision,
        text_encoder_precision=settings.text_encoder_precision,
        text_encoders=base_precision.stored_text(shape.family, model_dir)
        if base_precision.is_low(settings.text_encoder_precision)
        else None,
        optimizer=planned_optimizer(
            settings.optimizer,
            explicit="optimizer" in settings.model_fields_set,
            config_type=(base.get("optimizer") or {}).get("type"),
        ),  # fmt: skip
        pin_names=user.names,
        resolution_name=(
            env_name("resolution")
            if resolution == job_resolution(settings, shape)
            else f"the `resolution` of a {env_name('datasets_file')} entry"
        ),
    )
    return make_plan(
        shape=shape,
        hardware=hardware,
        request=request,
        training=trainable.for_settings(settings, shape, model_dir),
        offload_disk_free=offload_disk_free,
        require_fit=require_fit,
    )


def decisions_from(plan: Plan) -> Decisions:
    choice = plan.choice
    return Decisions(
        zero_stage=int(choice.zero_stage),
        offload_optimizer=choice.offload_optimizer,
        offload_param=choice.offload_param,
        gradient_checkpointing=bool(choice.gradient_checkpointing),
        offload_activations=choice.offload_activations,
    )


def check_reporting(settings: Settings) -> tuple[str, list[Target]]:
    """ZT_NOTIFY_URL and ZT_REPORT_TO refused here (exit 2), so every command refuses them as
    train does, and train before its ranks start: what they report to, in words, and the
    notification targets train notifies (the URL is a secret: `targets` names an entry by its
    position only)."""
    from zerotuner.monitor.trackers import wandb_mode
    from zerotuner.publish.notify import targets

    found, words = [], []
    if settings.notify_url:
        url = settings.notify_url.get_secret_value()
        found = targets(url, timeout_seconds=settings.notify_timeout_seconds)
        words.append(f"{len(found)} notification target(s)")
    if "wandb" in settings.report_to:
        words.append(f"W&B {wandb_mode(settings)}")
    return "; ".join(words) or "no notifications, no W&B", found
