"""What `zerotuner train` does while the ranks start: the plan, the offload volume, the job.

`train` starts the ranks first (they import torch, DeepSpeed and diffusers, seconds); this
module, imported after that, plans meanwhile and writes the job file they wait for. Nothing
here runs before the ranks exist, so its imports (torch, through the planner's modules) cost
the ranks nothing.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from zerotuner.commands.plan import render
from zerotuner.data.held_out import check_fraction
from zerotuner.data.scan import listed_samples
from zerotuner.launch.job import Job
from zerotuner.machine.offload_volume import mounted_offload_device, prepare_offload_dir
from zerotuner.preflight.fetch import fetch_all
from zerotuner.preflight.steps import Preflight, preflight
from zerotuner.preflight.what_if import plan_json
from zerotuner.settings.datasets import eval_sources, sources
from zerotuner.settings.schema import Settings
from zerotuner.weights.checkpoint import REMOTE_LATEST, checkpoints_dir

if TYPE_CHECKING:
    from zerotuner.launch.ranks import Topology
    from zerotuner.machine.hardware import Hardware
    from zerotuner.monitor.server import MetricsServer
    from zerotuner.publish.notify import Notifier
    from zerotuner.publish.push import Pusher
    from zerotuner.settings.effective import Effective

log = logging.getLogger("zerotuner.train")


def prepare(
    effective: Effective,
    *,
    hardware: Hardware,
    topology: Topology,
    job_file: Path,
    server: MetricsServer | None,
    stack: ExitStack,
    news: Notifier | None = None,
) -> Pusher | None:
    """Everything before the ranks may go: the plan, the offload volume, the job file, and on
    node 0 the checkpoint pusher (which may first fetch the checkpoint to resume from) and the
    start notification (`news`, node 0's)."""
    settings = effective.settings
    if settings.offload_device:
        stack.enter_context(
            mounted_offload_device(
                settings.offload_device, settings.offload_dir, allow_format=settings.offload_format
            )
        )
    pre = preflight(effective, hardware=hardware, topology=topology)
    _log_decisions(pre)
    choice = pre.plan.choice
    if "nvme" in (choice.offload_optimizer, choice.offload_param):
        # Once per node, before any rank starts: stale swap files make a resume load garbage.
        report = prepare_offload_dir(
            settings.offload_dir, need_bytes=choice.disk_bytes, nvme=True, clean=True
        )
        log.info("offload volume: %s", report.summary())
        for removed in report.removed:
            log.info("removed stale swap data: %s", removed)
        for warning in report.warnings:
            log.warning("%s", warning)
    # Once per node, after the plan held: remote datasets into the cache (preflight.fetch).
    fetch_all(sources(settings) + eval_sources(settings), settings)
    _check_held_out(settings)
    job = job_from(pre)
    if server is not None:
        server.set_job(job)
        server.set_plan(plan_json(pre.plan, pre.hardware))
        server.set_phase("loading")
    log.info(
        "launching %d rank(s) on node %d of %d (world size %d, %s)",
        topology.nproc_per_node, topology.node_rank, topology.nnodes, topology.world_size,
        topology.source,
    )  # fmt: skip
    pusher = None
    if topology.node_rank == 0:  # node 0 commits the checkpoints
        if settings.push_to:
            pusher = _start_pusher(settings, server)
        else:  # an earlier run's remote no longer holds back the local rotation
            (checkpoints_dir(settings.output_dir) / REMOTE_LATEST).unlink(missing_ok=True)
    if news is not None:
        from zerotuner.publish.notify import Event

        news.send(Event("start", _plan_line(pre)))
    job.write(job_file)  # the waiting ranks go on from here
    return pusher


def _check_held_out(settings: Settings) -> None:
    """ZT_EVAL_FRACTION leaves an image to train on (counted from the file names, each once):
    one line before the ranks load anything; the ranks check the scanned images again."""
    if settings.eval_fraction is None:
        return
    once = [source.model_copy(update={"repeats": 1}) for source in sources(settings)]
    total = listed_samples(once, settings.cache_dir, video=True)  # clips too: never too few
    if total:
        check_fraction(total, settings.eval_fraction)


def _plan_line(pre: Preflight) -> str:
    """The plan in one line, for someone not reading the log."""
    s, t = pre.settings, pre.topology
    nodes = f" on {t.nnodes} nodes" if t.nnodes > 1 else ""
    return (
        f"{pre.model.family} {s.training_type} training, {s.max_steps} steps, "
        f"{t.world_size} rank(s){nodes}: {pre.plan.choice.label()}; output {s.output_dir}"
    )


def _start_pusher(settings: Settings, server: MetricsServer | None) -> Pusher:
    """Node 0: resume from the remote when this machine has no checkpoint, then push each new
    one in the background (see zerotuner.publish.push)."""
    from zerotuner.publish import push
    from zerotuner.publish.remote import probe

    store = push.open_remote(settings)
    probe(store)  # credentials and write access, before the ranks spend GPU time
    if settings.resume == "auto":
        push.fetch_latest(store, settings.output_dir)
    pusher = push.Pusher(store, settings.output_dir, keep=settings.checkpoints_keep).start()
    if server is not None:
        server.registry.register(push.PushCollector(pusher.stats))
    log.info("pushing checkpoints, the final export and run records to %s", store.url)
    return pusher


def job_from(pre: Preflight) -> Job:
    d, t = pre.decisions, pre.topology
    return Job(
        family=pre.model.family,
        model=pre.model.job_model,
        revision=pre.model.revision,
        denoiser_params=pre.shape.denoiser_params,
        resolution=pre.resolution,
        zero_stage=d.zero_stage,
        offload_optimizer=d.offload_optimizer,
        offload_param=d.offload_param,
        gradient_checkpointing=d.gradient_checkpointing,
        offload_activations=d.offload_activations,
        mixed_precision=pre.normalized.mixed_precision,
        device="cpu" if pre.hardware.accelerator == "cpu" else "cuda",
        world_size=t.world_size,
        nnodes=t.nnodes,
        nproc_per_node=t.nproc_per_node,
        node_rank=t.node_rank,
        master_addr=t.master_addr,
        master_port=t.master_port,
        deepspeed=pre.normalized.config,
        notes=tuple(str(n) for n in pre.notes),
    )


def _log_decisions(pre: Preflight) -> None:
    """The plan, every normalization change, and the effective DeepSpeed config."""
    log.info("plan:\n%s", render(pre.plan, pre.hardware))
    for note in pre.notes:
        if note.level == "warning":
            log.warning("%s", note.message)
        else:
            log.info("%s", note)
    log.info("effective DeepSpeed config:\n%s", json.dumps(pre.normalized.config, indent=2))
