"""`zerotuner check`: every validation `train` makes, without training (the dry run to trust
before renting GPUs). Each check prints OK, WARN, SKIP or FAIL.

The first checks are the very steps `train` takes before its ranks start, reported one by
one: the settings path (effective.SettingsPath) and preflight (preflight.PreflightRun), so
what `check` accepts `train` starts and what it refuses `train` refuses with the same line;
each of these needs the one before. Then what `train` meets later (the dataset, the text
cache, the offload volume, writable folders, ports, the push remote), each run regardless.

Exit 2 when any check found a configuration or input error, else 3 when the environment
cannot run the job, else 0. Nothing is created, cleaned, mounted or formatted, but for a hub
model's config files (a few KB), which reach the Hugging Face cache as they do for `train`.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import (
    EXIT_CONFIG,
    EXIT_ENVIRONMENT,
    EXIT_FAILURE,
    EXIT_OK,
    ConfigError,
    EnvironmentUnfit,
    ZeroTunerError,
)

if TYPE_CHECKING:
    from zerotuner.data.dataset import Dataset

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Checks:
    """Runs checks in order, records each outcome, and keeps what later checks need."""

    lines: list[str] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], str | tuple[str, list[str]]]) -> bool:
        try:
            result = fn()
        except ZeroTunerError as error:
            self.codes.append(error.exit_code)
            for i, problem in enumerate(error.problems):
                self.emit("FAIL" if i == 0 else "    ", name, problem)
            return False
        except Exception as error:  # a bug, not a verdict: report it and keep checking
            self.codes.append(EXIT_FAILURE)
            self.emit("FAIL", name, f"unexpected {type(error).__name__}: {error}")
            return False
        detail, warnings = result if isinstance(result, tuple) else (result, [])
        self.emit("OK", name, detail)
        for warning in warnings:
            self.emit("WARN", name, warning)
        return True

    def skip(self, name: str, why: str) -> None:
        self.emit("SKIP", name, why)

    def emit(self, status: str, name: str, detail: str) -> None:
        line = f"{status:<4} {name:<16} {detail}"
        self.lines.append(line)
        print(line, flush=True)

    def exit_code(self) -> int:
        if EXIT_CONFIG in self.codes:
            return EXIT_CONFIG
        if self.codes:
            return EXIT_ENVIRONMENT if EXIT_ENVIRONMENT in self.codes else max(self.codes)
        return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from zerotuner.preflight.steps import PreflightRun
    from zerotuner.settings.effective import SettingsPath

    c = Checks()
    # The steps train takes before its ranks start, reported one by one: the settings path,
    # then preflight's (each needs the one before); then what train meets later on.
    path = SettingsPath()
    for name, step in path.STEPS:
        ok = c.run(name, functools.partial(step, path))
        if path.settings is None:  # nothing to check the rest against
            return c.exit_code()
        c.facts["settings"] = path.settings
        if ok and path.inputs is not None:
            c.facts["inputs"] = path.inputs
    if "inputs" in c.facts:
        pre = PreflightRun(path.effective())
        for name, pre_step in pre.STEPS:
            if not c.run(name, functools.partial(pre_step, pre)):
                if name == "hardware":  # no machine to check the job against
                    return _finish(c)
                break
        c.facts |= {"topology": pre.topology, "plan": pre.plan, "model": pre.model,
                    "model_shape": pre.shape}  # fmt: skip
    else:
        c.skip("preflight", "the config files above must read first")
    c.facts = {k: v for k, v in c.facts.items() if v is not None}
    if c.run("dataset", lambda: _dataset(c)) and "plan" in c.facts and c.facts["dataset"]:
        c.run("text cache", lambda: _text_cache(c))
        if "model" in c.facts and c.facts["model"].local_dir is not None:
            c.run("latent cache", lambda: _latent_cache(c))
    if "inputs" not in c.facts:  # their nvme_path may name the offload folder
        c.skip("offload", "the config files above must read first")
    elif "plan" in c.facts or c.facts["settings"].offload_device:
        c.run("offload", lambda: _offload(c))
    else:
        c.skip("offload", "needs a plan to know what NVMe offload needs")
    c.run("output dir", lambda: _writable(c, "output_dir"))
    c.run("cache dir", lambda: _writable(c, "cache_dir"))
    c.run("metrics port", lambda: _port(c))
    if c.facts["settings"].push_to:
        c.run("push remote", lambda: _remote(c))
    t = c.facts.get("topology")
    if t is not None and t.nnodes > 1 and t.node_rank == 0 and t.master_port:
        c.run("rendezvous port", lambda: _rendezvous_port(c))
    return _finish(c)


def _remote(c: Checks) -> str:
    from zerotuner.publish.push import open_remote
    from zerotuner.publish.remote import probe

    store = open_remote(c.facts["settings"])
    probe(store)  # credentials, the bucket or repo, write access: exit 3 with one line
    return f"{store.url}: writable (a probe object written, read back and deleted)"


def _finish(c: Checks) -> int:
    code = c.exit_code()
    verdict = "ready to train" if code == EXIT_OK else f"not ready (exit {code})"
    print(f"check: {verdict}", file=sys.stderr if code else sys.stdout)
    return code


def _eval_control_count(s: Any, dataset: Any, counts: range) -> None:
    """ZT_EVAL_DATA_DIR's targets have the training targets' control image count, refused as
    the ranks refuse it (controls.one_count); a remote one is read by the ranks alone."""
    from zerotuner.data.controls import one_count
    from zerotuner.data.scan import scan_sources
    from zerotuner.settings.datasets import eval_sources

    local = [e for e in eval_sources(s) if not e.location.remote]
    if local:
        held = scan_sources(local, s.cache_dir, log_skipped=False, write_index=False,
                            min_image_size=s.min_image_size, control_count=counts,
                            setting="ZT_EVAL_DATA_DIR")  # fmt: skip
        one_count("ZT_EVAL_DATA_DIR", dataset.items, held.items)


def _dataset(c: Checks) -> tuple[str, list[str]]:
    from zerotuner import families
    from zerotuner.data.clips import video_sampling
    from zerotuner.data.notes import recipe_notes
    from zerotuner.data.scan import scan_sources
    from zerotuner.preflight.fetch import fetch_all
    from zerotuner.preflight.steps import job_resolution
    from zerotuner.settings.datasets import sources

    s = c.facts["settings"]
    found = sources(s)
    remote = fetch_all(found, s, listing_only=True)  # what is fetched, what is still to fetch
    if remote.missing:
        c.facts["dataset"] = None
        return remote.describe(), []
    source = c.facts.get("model")
    video = None
    if source is not None and source.local_dir is not None:  # as train samples clips
        video = video_sampling(s, families.get(source.family), source.local_dir)
    c.facts["video"] = video
    dataset = scan_sources(
        found, s.cache_dir, log_skipped=False, write_index=False,
        min_image_size=s.min_image_size, video=video, datasets_file=s.datasets_file,
        control_count=families.REGISTRY[source.family].control_counts if source else 0,
    )  # fmt: skip
    if source is not None and families.REGISTRY[source.family].controls:
        _eval_control_count(s, dataset, families.REGISTRY[source.family].control_counts)
    warnings = dataset.warnings()  # the lines train logs
    shape = c.facts.get("model_shape")  # as train: ZT_RESOLUTION, else the family's own
    resolution = job_resolution(s, shape) if shape else s.resolution
    step = c.facts["bucket_step"] = _bucket_step(c, resolution) if resolution else 64
    if resolution:
        warnings += _upscaled(dataset, resolution, upscale=s.upscale, step=step)
    c.facts["dataset"] = dataset
    notes = recipe_notes(
        dataset, resolution, multiple=step, caption_template=s.caption_template,
        caption_dropout=s.caption_dropout, min_image_size=s.min_image_size, upscale=s.upscale,
        timestep_range=s.timestep_range,
    )  # fmt: skip
    fetched = f"; {remote.describe()}" if remote.sources else ""
    epoch = f"; {dataset.epoch_samples} samples an epoch" if dataset.parts else ""
    line = dataset.summary() + epoch + fetched + "".join(f"; {n}" for n in notes)
    return line, warnings


def _upscaled(dataset: Dataset, resolution: int, *, upscale: bool, step: int) -> list[str]:
    """The upscale line of each dataset at the side it trains at: its own `resolution`, else
    the job's (one line for all when there is one dataset); `step`: the bucket step."""
    from zerotuner.data.notes import upscale_warning

    def line(data: Dataset, side: int) -> str | None:
        return upscale_warning(data, side, multiple=step, upscale=upscale)

    if not dataset.parts:
        found = line(dataset, resolution)
        return [found] if found else []
    lines = [
        (part.label, line(part.dataset, part.resolution or resolution)) for part in dataset.parts
    ]
    return [f"{label}: {text}" for label, text in lines if text]


def _text_cache(c: Checks) -> str:
    """The captions' cached text states against the free space at ZT_CACHE_DIR (T5's make them
    large: up to 4 MiB a caption for Flux)."""
    from zerotuner import families
    from zerotuner.machine.offload_volume import free_bytes_at

    settings, plan, model = c.facts["settings"], c.facts["plan"], c.facts.get("model")
    captions = len({item.caption for item in c.facts["dataset"].items})
    captions += settings.caption_dropout > 0  # the empty caption, cached once
    if model is not None and families.REGISTRY[model.family].captions_per_item:
        # read with each image's control (Qwen-Image-Edit): one per image and mirror image
        captions = len(c.facts["dataset"].items) * (2 if settings.random_flip else 1)
    need = captions * plan.inputs.caption_cache_bytes
    free = free_bytes_at(settings.cache_dir) or 0
    size = f"{captions} captions x {plan.inputs.caption_cache_bytes / 2**20:.2f} MiB = "
    size += f"{need / 2**30:.2f} GiB at most (ZT_CACHE_DIR={settings.cache_dir})"
    if need > free:
        raise EnvironmentUnfit(
            f"text cache: {size}, but only {free / 2**30:.2f} GiB are free there; free space, "
            "point ZT_CACHE_DIR at a larger disk or shorten ZT_MAX_SEQUENCE_LENGTH"
        )
    return f"{size}; {free / 2**30:.1f} GiB free"


def _latent_cache(c: Checks) -> str:
    """The images' and clips' cached latents at the buckets train will use (fp32)."""
    from zerotuner import families
    from zerotuner.data.buckets import bucket_name, dataset_buckets
    from zerotuner.preflight.steps import job_resolution
    from zerotuner.train.feature_cache import latent_cache_bytes

    s, dataset, model = c.facts["settings"], c.facts["dataset"], c.facts["model"]
    video = c.facts.get("video")  # as `_dataset` sampled the clips
    resolution = job_resolution(s, c.facts["model_shape"])  # as train's
    step = c.facts.get("bucket_step") or _bucket_step(c, resolution)  # `_dataset`'s
    buckets = dataset_buckets(dataset, resolution, multiple=step, upscale=s.upscale)
    need = latent_cache_bytes(
        buckets, channels=families.vae_latent_channels(model.local_dir),
        scale=families.vae_scale(model.local_dir), frame_step=video.step if video else None,
        flip=s.random_flip, controls=len(dataset.items[0].controls),  # the run's one count
    )  # fmt: skip
    clip_buckets = sorted({b[2] for b in buckets if len(b) == 3})
    frames = f"; clips of {', '.join(map(str, clip_buckets))} frames" if clip_buckets else ""
    names = sorted(bucket_name(b) for b in buckets)
    shown = ", ".join(names[:SHOWN_BUCKETS]) + (", ..." if len(names) > SHOWN_BUCKETS else "")
    return (
        f"{len(buckets)} buckets ({shown}){frames}: about {need / 2**20:.1f} MiB of latents "
        f"(ZT_CACHE_DIR={s.cache_dir})"
    )


SHOWN_BUCKETS = 12  # the latent-cache line names the first buckets, sorted


def _bucket_step(c: Checks, resolution: int) -> int:
    """The bucket step train's ranks will use (families.bucket_step, the one rule), for the
    model `check` resolved; the image families' 64 px without one."""
    from zerotuner import families

    model, s = c.facts.get("model"), c.facts["settings"]
    if model is None:
        return 64
    denoiser = families.EXPERTS[s.expert] if s.expert else None
    return families.bucket_step(
        model.family, model.local_dir, resolution=resolution, denoiser=denoiser
    )


def _offload(c: Checks) -> tuple[str, list[str]] | str:
    from zerotuner.machine.offload_volume import filesystem_of, prepare_offload_dir

    settings = c.facts["settings"]
    plan = c.facts.get("plan")
    if settings.offload_device:
        device = settings.offload_device
        if not Path(device).is_block_device():
            raise ConfigError(f"ZT_OFFLOAD_DEVICE={device}: not a block device")
        fs = filesystem_of(device)
        if fs is None and not settings.offload_format:
            raise ConfigError(
                f"ZT_OFFLOAD_DEVICE={device} has no filesystem; set ZT_OFFLOAD_FORMAT=true to "
                "format it as ext4 (erases the device)"
            )
        if os.geteuid() != 0:
            raise EnvironmentUnfit(
                f"ZT_OFFLOAD_DEVICE={device}: mounting needs root in a privileged container"
            )
        return f"{device} ({fs or 'blank: will be formatted'}) will be mounted at " + str(
            settings.offload_dir
        )
    if not (plan and plan.choice.disk_bytes):
        return f"{settings.offload_dir}: not used (the plan offloads nothing to NVMe)"
    report = prepare_offload_dir(
        settings.offload_dir,
        need_bytes=plan.choice.disk_bytes,
        nvme=True,
        clean=False,
        create=False,
    )
    return report.summary(), list(report.warnings)


def _writable(c: Checks, name: str) -> str:
    from zerotuner.settings.folders import writable
    from zerotuner.settings.schema import env_name

    return writable(getattr(c.facts["settings"], name), env_name(name))


def _port(c: Checks) -> str:
    settings = c.facts["settings"]
    if settings.metrics_port == 0:
        return "metrics disabled (ZT_METRICS_PORT=0)"
    _bindable(settings.metrics_host, settings.metrics_port, "ZT_METRICS_PORT", "or 0 to disable")
    return f"{settings.metrics_host}:{settings.metrics_port} free"


def _rendezvous_port(c: Checks) -> str:
    """Node 0 of a multi-node job hosts torchrun's rendezvous store on the master port."""
    t = c.facts["topology"]
    _bindable("0.0.0.0", t.master_port, "ZT_MASTER_PORT", "on node 0")
    return f"{t.master_port} free on node 0 (the rendezvous store)"


def _bindable(host: str, port: int, name: str, hint: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise EnvironmentUnfit(
                f"{name}={port} on {host}: {why}; pick a free port {hint}"
            ) from None
